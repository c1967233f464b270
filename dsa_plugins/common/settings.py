"""Settings read from the environment, and the one-time warning helper (used by every layer).

- ``DSA_PLUGINS_BACKEND``: default backend of every op, "auto" | "tilelang" | "torch" (default "auto").
- ``DSA_PLUGINS_CHECK_INDICES=1``: check every index against its range before running (costs a
  device->host sync per call; for debugging).
- ``DSA_PLUGINS_DETERMINISTIC=1``: bitwise run-to-run stable backward kernels (slower; see README); a
  deterministic mode's name instead of 1 (e.g. ``contrib_i16``) turns it on with that mode. In code:
  ``with dsa_plugins.deterministic():`` around the forward.
- ``DSA_PLUGINS_AUTOLOAD=0``: do not install the framework import hooks at ``import torch``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading

logger = logging.getLogger("dsa_plugins")

BACKENDS = ("auto", "tilelang", "torch")

_warned: set[str] = set()
_warned_lock = threading.Lock()


_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in _ON


def default_backend() -> str:
    value = os.environ.get("DSA_PLUGINS_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"DSA_PLUGINS_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


def resolve_backend(backend: str | None) -> str:
    """``None`` -> the environment's default; otherwise validated as given."""
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_indices_enabled() -> bool:
    return _flag("DSA_PLUGINS_CHECK_INDICES")


_FORCED_DETERMINISTIC = contextvars.ContextVar("dsa_plugins_deterministic", default=False)


def deterministic_enabled() -> bool:
    """DSA_PLUGINS_DETERMINISTIC: 1 / true / yes / on, or a deterministic mode's name (see
    :func:`deterministic_mode`), turns the bitwise-reproducible backward on; so do a :func:`deterministic`
    block and torch's own switch, ``torch.use_deterministic_algorithms(True)`` (what transformers'
    ``enable_full_determinism`` sets)."""
    if _FORCED_DETERMINISTIC.get():
        return True
    if os.environ.get("DSA_PLUGINS_DETERMINISTIC", "0").strip().lower() not in _OFF:
        return True
    import torch  # not at module level: this module is imported while torch itself imports (autoload)

    return torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def deterministic():
    """Ops whose forward runs inside the block take the deterministic backward (as with
    DSA_PLUGINS_DETERMINISTIC=1; the flag is read in the forward and kept for its backward, which may run
    after the block). The Megatron adapter enters it for layers whose config sets ``deterministic_mode``."""
    token = _FORCED_DETERMINISTIC.set(True)
    try:
        yield
    finally:
        _FORCED_DETERMINISTIC.reset(token)


def deterministic_mode() -> str | None:
    """The backward's deterministic mode named by DSA_PLUGINS_DETERMINISTIC (e.g. "contrib_i16"), or None
    where it is a plain on / off value (the kernel's default mode). The kernel checks the name."""
    value = os.environ.get("DSA_PLUGINS_DETERMINISTIC", "0").strip().lower()
    return None if value in _OFF or value in _ON else value


def decode_part_slots() -> int:
    """DSA_PLUGINS_DECODE_PART_SLOTS: one-query (decode) rows of the sparse attention forward are cut
    into parts of this many slots, each on a CTA of its own, writing fp32 partials that a combine program
    merges (0, the default: off, and the cluster split of decode_cluster_parts applies instead). A function of
    k only, never of the batch, so rows stay batch invariant; it speeds up small batches and slows large ones
    (benchmarks/results/attention_decode.md)."""
    return _slot_count("DSA_PLUGINS_DECODE_PART_SLOTS", "0")


def _env_count(name: str, default: str, unit: str) -> int:
    """The variable ``name`` as a whole number (an empty value is 0), with a message naming it otherwise."""
    raw = os.environ.get(name, default).strip() or "0"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of {unit}, got {raw!r}") from None


def _slot_count(name: str, default: str) -> int:
    value = _env_count(name, default, "slots")
    if value < 0 or value % 128:
        raise ValueError(f"{name} must be 0 or a positive multiple of 128, got {value}")
    return value


#: parts of one decode row's slots that one cluster merges at most (the portable cluster size)
DECODE_CLUSTER_MAX_PARTS = 8


def decode_cluster_parts(k: int, heads: int) -> int:
    """How many parts (CTAs of one cluster, merged through distributed shared memory) a one-query (decode)
    row of k slots and ``heads`` query heads is cut into: DSA_PLUGINS_DECODE_ROW_CTAS (default 2) is how
    many CTAs one row may spread over, its 64-head blocks times its parts; the parts are a power of two, at
    most 8, each with at least 128 slots. 0 means one CTA per head block (no split).

    A function of k and the head count only, never of the batch: rows stay batch invariant. The default
    splits the rows of models with up to 64 heads in two (H100, k 2048: 1.6x at B 1-32, 1.07x at B 64) and
    leaves 128-head rows whole, on the prefill's seesaw program (two parts: 1.38-1.47x at B 1-32 but 0.97x at
    B 64 and 0.93x at B 128); 8 takes B 1-8 to about 3.2x at 0.75x at B 64
    (benchmarks/results/attention_decode.md)."""
    ctas = _env_count("DSA_PLUGINS_DECODE_ROW_CTAS", "2", "CTAs")
    if ctas < 0:
        raise ValueError(f"DSA_PLUGINS_DECODE_ROW_CTAS must be >= 0, got {ctas}")
    head_blocks = -(-heads // 64)
    slots = -(-k // 128) * 128
    parts = 1
    while parts < DECODE_CLUSTER_MAX_PARTS and 2 * parts * head_blocks <= ctas and 2 * parts * 128 <= slots:
        parts *= 2
    return parts if parts > 1 else 0


def autoload_enabled() -> bool:
    return os.environ.get("DSA_PLUGINS_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off")


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


def reset_warnings() -> None:
    """Forget which warnings were given (tests)."""
    with _warned_lock:
        _warned.clear()
