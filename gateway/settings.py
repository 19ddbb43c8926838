"""Settings of the gateway (flags `--field-name`, environment `SLUICE_FIELD_NAME`). Above
`gateway.choices` alone (the names and address forms the settings accept); every other module of the
gateway may read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.choices import (
    REASONING_PARSERS,
    ROUTING_POLICIES,
    TOOL_CALL_PARSERS,
    Endpoint,
    check_allowed_hosts,
)
from services.common.settings import ValidatedSettings, check_bounds, check_choices


@dataclass(frozen=True)
class GatewaySettings(ValidatedSettings):
    """sluice gateway: WebSocket, HTTP and gRPC front door of the pipeline."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (HTTP and gRPC)"})
    port: int = field(default=8000, metadata={"help": "HTTP/WebSocket port (0 = any free port)"})
    grpc_port: int = field(default=50050, metadata={"help": "public gRPC API port (0 = any free port)"})
    tokenizer: tuple[str, ...] = field(
        default=("127.0.0.1:50051",),
        metadata={
            "help": "tokenizer replicas, comma-separated host:port, or dns:///name:port for every "
            "address the name resolves to (re-resolved every --resolve-interval-s)"
        },
    )
    engine: tuple[str, ...] = field(
        default=("127.0.0.1:50052",),
        metadata={"help": "engine replicas, comma-separated host:port or dns:///name:port"},
    )
    detokenizer: tuple[str, ...] = field(
        default=("127.0.0.1:50053",),
        metadata={"help": "detokenizer replicas, comma-separated host:port or dns:///name:port"},
    )
    resolve_interval_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds between re-resolutions of the dns:/// names (also re-resolved when no "
            "replica of a stage is connected)"
        },
    )
    channels_per_replica: int = field(
        default=1,
        metadata={
            "help": "connections to each tokenizer and detokenizer replica, the work spread over them "
            "(one multiplexed detokenizer stream each): for replicas running --workers N, about 4N, "
            "so every worker gets work (the kernel hands each connection to one); engines get one"
        },
    )
    default_temperature: float = field(
        default=1.0, metadata={"help": "temperature when a request gives none (0 = greedy)"}
    )
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "longest a request may run, tokenizing to the last token"}
    )
    tokenize_timeout_s: float = field(default=30.0, metadata={"help": "deadline of one Tokenize call"})
    health_timeout_s: float = field(default=2.0, metadata={"help": "deadline of one upstream health check"})
    readyz_cache_s: float = field(
        default=1.0, metadata={"help": "how long /readyz reuses its latest round of upstream health checks"}
    )
    grace_s: float = field(
        default=5.0, metadata={"help": "seconds generations in flight may finish on SIGTERM"}
    )
    detokenizer_context_ids: int = field(
        default=4, metadata={"help": "last prompt ids sent to the detokenizer as context"}
    )
    max_in_flight: int = field(
        default=1024, metadata={"help": "most generations running at once; beyond it: refused (0 = no cap)"}
    )
    max_generations: int = field(
        default=64,
        metadata={"help": "most generations one request may ask for (OpenAI: prompts times n); beyond: 400"},
    )
    max_request_tokens: int = field(
        default=0,
        metadata={
            "help": "most tokens one request may ask for, summed over its generations (each its max_tokens, "
            "or the whole context when it gives none); beyond: 400 (0 = 16 times the model's context length)"
        },
    )
    max_prompt_tokens: int = field(
        default=0,
        metadata={
            "help": "longest prompt in tokens (0 = the engine's rule, checked early: shorter than the "
            "model's context length, which must hold at least one output token)"
        },
    )
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"help": "largest HTTP request body"})
    max_ws_frame_bytes: int = field(default=1024 * 1024, metadata={"help": "largest WebSocket frame"})
    ws_ping_interval_s: float = field(
        default=20.0, metadata={"help": "WebSocket keep-alive ping interval (a pong must follow in as long)"}
    )
    sse_keepalive_s: float = field(
        default=15.0, metadata={"help": "idle seconds before an SSE stream sends a keep-alive comment"}
    )
    retry_after_s: int = field(default=1, metadata={"help": "Retry-After seconds sent with a 429"})
    api_keys: tuple[str, ...] = field(
        default=(), metadata={"help": "accepted API keys, comma-separated (none = open)"}
    )
    api_keys_file: str = field(default="", metadata={"help": "file of accepted API keys, one a line"})
    served_model_name: str = field(
        default="", metadata={"help": "model name the APIs answer to (default: the model directory's name)"}
    )
    upstream_wait_s: float = field(
        default=15.0,  # a standby's take-over, 4-6.4 s on 2 loaded cores, and a quiet cold restart
        metadata={
            "help": "longest a request waits for a stage that is connecting or restarting (within its "
            "deadline) before it fails with unavailable (default: 15)"
        },
    )
    routing: str = field(
        default="prefix_affinity",
        metadata={
            "help": "how a request's engine replica is chosen: round_robin | least_load | prefix_affinity "
            "(the replica holding the longest prefix of the prompt, among those within --routing-margin "
            "of the least loaded)"
        },
    )
    routing_margin: int = field(
        default=4,
        metadata={
            "help": "prefix_affinity: requests more than the least loaded replica's that a replica may have "
            "and still be chosen for its cached prefix"
        },
    )
    routing_margin_ratio: float = field(
        default=0.25,
        metadata={
            "help": "prefix_affinity: the same margin as a fraction of the least loaded replica's load; the "
            "larger of the two applies (4 requests at low load, a quarter more at high load)"
        },
    )
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "browser Origins that may use the WebSocket and the HTTP API besides the gateway's own, "
            "comma-separated, '*' = any (a client that sends no Origin, not a browser, is always accepted)"
        },
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "host names the HTTP API and WebSocket answer to (the Host header, against DNS "
            "rebinding), comma-separated, any port of each (an entry with a port is refused), '*' = any; "
            "default: the loopback names and --host (any when --host is 0.0.0.0 or ::)"
        },
    )
    ws_auth_timeout_s: float = field(
        default=10.0, metadata={"help": "seconds a WebSocket has to send its auth frame when API keys are on"}
    )
    ws_max_in_flight: int = field(
        default=16, metadata={"help": "most generations one WebSocket may run at once (0 = no cap)"}
    )
    send_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "longest one write to a client may block (a client that stops reading) before the "
            "request is cancelled and the connection closed"
        },
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "help": "how chat completions read tool calls in the generated text: auto (the format the "
            "model's chat template writes, else hermes) | hermes (<tool_call> blocks: Qwen, Hermes, the tiny "
            "model) | llama3_json (Llama 3.1 and later) | mistral ([TOOL_CALLS])"
        },
    )
    reasoning_parser: str = field(
        default="auto",
        metadata={
            "help": "think = chat completions give <think>...</think> text as reasoning_content "
            "(DeepSeek-R1, Qwen3) | none | auto (think when the model's chat template writes <think>)"
        },
    )
    tls_ca_file: str = field(
        default="", metadata={"help": "PEM CA that signs the stages' certificates (set = TLS to the stages)"}
    )
    tls_cert_file: str = field(
        default="", metadata={"help": "PEM client certificate for mutual TLS to the stages"}
    )
    tls_key_file: str = field(default="", metadata={"help": "PEM key of --tls-cert-file"})

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        for name in ("tokenizer", "engine", "detokenizer"):
            if not getattr(self, name):
                raise ValueError(f"{name} needs at least one host:port address")
            for address in getattr(self, name):
                try:
                    Endpoint.parse(address)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        check_bounds(self, _BOUNDS)
        check_allowed_hosts(self.allowed_hosts)
        check_choices(
            self,
            (
                ("routing", ROUTING_POLICIES),
                ("tool_call_parser", TOOL_CALL_PARSERS),
                ("reasoning_parser", REASONING_PARSERS),
            ),
        )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError("tls_cert_file needs tls_ca_file")


# The numeric settings' bounds (`check_bounds`).
_BOUNDS = (
    (">", 0, ("resolve_interval_s", "request_timeout_s", "tokenize_timeout_s", "health_timeout_s")),
    (">", 0, ("max_body_bytes", "max_ws_frame_bytes", "ws_ping_interval_s", "sse_keepalive_s")),
    (">", 0, ("ws_auth_timeout_s", "send_timeout_s")),
    (">=", 1, ("channels_per_replica", "max_generations")),
    (">=", 0, ("max_request_tokens",)),
    (">=", 0, ("default_temperature", "grace_s", "detokenizer_context_ids", "max_in_flight")),
    (">=", 0, ("max_prompt_tokens", "retry_after_s", "upstream_wait_s", "readyz_cache_s")),
    (">=", 0, ("ws_max_in_flight", "routing_margin", "routing_margin_ratio")),
)
