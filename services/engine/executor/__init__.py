"""The executor: the model on its device, the KV pool, attention, sampling."""
