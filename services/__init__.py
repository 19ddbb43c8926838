"""sluice's four services.

Importing this package quiets two libraries' import-time warnings that tell a sluice user nothing:
transformers imports torchao whenever it is installed, and on a CPU build of torch torchao logs each of its
CUDA-only extensions failing to load, and torch's pytree registry warns about torchao's enum
registrations. Errors from both still show. The `sluice` package imports this one first for the same
reason.
"""

import logging

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
