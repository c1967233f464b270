"""DeepSeek-V4's cache in fixed buffers under ``dsa_tilelang``: generation steps as one compiled graph.

transformers' V4 cache layers grow by concatenation (the sliding window, each compressor's tokens of an unfinished
window, its compressed entries, the CSA overlap state) and its compressors branch on how many windows a call
closes, so every step has new shapes: no CUDA graph, and transformers ships V4 without a static cache. Here each
layer keeps fixed buffers:

* the sliding window: a ring of W rows, the token at position p in row p % W;
* per compressor (``"compressor"``, plus ``"indexer"`` on CSA layers): the raw kv and gate projections of the last
  2 * rate tokens in a ring (token p in row p % (2 * rate)), and the compressed entries [B, n_rows, D] (window w in
  row w);
* one length counter (a tensor), advanced in place by the sliding update of each call.

A call with S new tokens (prefill or a generation step: the same code, no data-dependent shape) gathers the tokens of
every window the new tokens touch, plus the window before (CSA's overlap: entry w pools window w-1's first half and
window w's second half), from the ring and the new rows, and pools each window as transformers' compressors do
(softmax over the slots with the position bias in fp32, kv_norm, rope at the window's first position). A window still
open is written too, past the count of closed windows (``length // rate``), and written again when later tokens
close it. The attention handler (:func:`.deepseek_v4.v4_attention`) receives [ring rows, new rows, entry rows] and
maps positions onto them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

__all__ = ["DsaV4StaticCache", "DsaV4StaticLayer", "compress_static"]


def _mark_static(*tensors: torch.Tensor) -> None:
    """Fixed addresses for CUDA graphs, as transformers marks its own static buffers (not while tracing)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class DsaV4StaticLayer(StaticLayer):
    """One V4 layer's fixed-size cache (see the module docstring).

    ``compress_rate`` is None for a sliding-window layer; ``names`` lists the layer's compressors.
    The mask transformers builds from it covers absolute positions [0, max_cache_len) (``get_mask_sizes``: that
    length, offset 0), so that no Python number in it changes from one step to the next.

    ``step_kv`` (on by default; layers with a compressor): a copy of the window ring followed by the compressor's
    entries, in one buffer [B, W + n_rows, D] (``self.step_kv``; the entries live only there, every write goes to the
    buffer itself, no view of another), which a generation step's attention reads as its keys. transformers'
    concatenation of the window and every entry (a copy of the whole cache per step: 1 GiB at B 32 x 128K) is then
    left without a reader in a compiled step. H200, one V4-Flash CSA layer at B 32 x 128K: 0.65 ms a compiled step
    against 1.16 without it. (The ring and the entries as views of one buffer instead lost the CUDA graph: 5.5-6.2 ms.)
    ``step_kv=False``: no second copy of the ring, and transformers concatenates the whole cache every step.
    """

    dsa_v4_static = True  # what the patched modules recognise the layer by (without importing this module)
    is_sliding = False
    supports_early_init = False  # the compressors' buffers take their sizes from the modules at the first call

    def __init__(self, max_cache_len: int, sliding_window: int, compress_rate: int | None = None,
                 names: tuple[str, ...] = (), step_kv: bool = True):
        super().__init__(max_cache_len=max_cache_len)
        if sliding_window is None or int(sliding_window) < 1:
            raise ValueError(f"DsaV4StaticLayer: sliding_window must be a positive int, got {sliding_window!r}")
        self.window = int(sliding_window)
        self.compress_rate = compress_rate
        self.names = tuple(names)
        self.rows = (max_cache_len - 1) // compress_rate + 2 if compress_rate else 0  # + the last open window
        self.ring_kv: dict[str, torch.Tensor] = {}
        self.ring_gate: dict[str, torch.Tensor] = {}
        self.entries: dict[str, torch.Tensor] = {}
        self.use_step_kv = bool(step_kv) and "compressor" in self.names
        self.step_kv: torch.Tensor | None = None

    @property
    def is_croppable(self) -> bool:
        return False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size = key_states.shape[0]
        self.keys = key_states.new_zeros(self.batch_size, key_states.shape[1], self.window, key_states.shape[-1])
        self.values = self.keys  # V4 reads one tensor as keys and values
        self.cumulative_length = self.cumulative_length.to(self.device)
        _mark_static(self.keys, self.cumulative_length)
        if self.use_step_kv:
            self.step_kv = key_states.new_zeros(self.batch_size, self.window + self.rows, key_states.shape[-1])
            _mark_static(self.step_kv)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the S new rows into the window's ring; return [ring rows (W), new rows (S)] as keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        S = key_states.shape[-2]
        if not torch.compiler.is_compiling():  # the rings would wrap silently past the end: an error instead (a
            # device-side assert on a GPU, no host sync; a compiled step runs no check, as transformers' caches)
            torch._assert_async(self.cumulative_length + S <= self.max_cache_len,
                                f"DsaV4StaticCache: more tokens than its max_cache_len ({self.max_cache_len})")
        full = torch.cat([self.keys, key_states], dim=-2)
        keep = min(S, self.window)
        rows = (torch.arange(S - keep, S, device=self.device) + self.cumulative_length).remainder(self.window)
        self.keys.index_copy_(2, rows, key_states[:, :, S - keep:])
        if self.step_kv is not None:
            self.step_kv.index_copy_(1, rows, key_states[:, 0, S - keep:])
        self.cumulative_length.add_(S)
        return full, full

    def compressor_buffers(self, name: str, kv: torch.Tensor, gate: torch.Tensor, dim: int):
        """The ring of raw projections and the entry rows of compressor ``name``, made at its first call."""
        if name not in self.entries:
            if name not in self.names:
                raise KeyError(f"DsaV4StaticLayer: no compressor {name!r} on this layer (has {self.names})")
            B, ring = kv.shape[0], 2 * self.compress_rate
            self.ring_kv[name] = kv.new_zeros(B, ring, kv.shape[-1])
            self.ring_gate[name] = gate.new_zeros(B, ring, gate.shape[-1])
            _mark_static(self.ring_kv[name], self.ring_gate[name])
            if not self._in_step_kv(name):
                self.entries[name] = kv.new_zeros(B, self.rows, dim)
                _mark_static(self.entries[name])
            else:  # for reading outside a compiled step (the step itself makes its own view of step_kv)
                self.entries[name] = self.step_kv[:, self.window:]
        entries = self.step_kv[:, self.window:] if self._in_step_kv(name) else self.entries[name]
        return self.ring_kv[name], self.ring_gate[name], entries

    def _in_step_kv(self, name: str) -> bool:
        return name == "compressor" and self.step_kv is not None

    def write_entries(self, name: str, windows: torch.Tensor, values: torch.Tensor) -> None:
        """Entry rows ``windows`` of compressor ``name`` (in the step buffer itself when it holds them)."""
        if self._in_step_kv(name):
            self.step_kv.index_copy_(1, windows + self.window, values.to(self.step_kv.dtype))
        else:
            self.entries[name].index_copy_(1, windows, values.to(self.entries[name].dtype))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("DsaV4StaticLayer cannot be cropped: its window and compressor rings keep only "
                                  "the latest tokens")

    def reset(self) -> None:
        super().reset()
        for t in self._buffers():
            t.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        for t in [self.keys, *self._buffers()]:
            t.copy_(t.index_select(0, beam_idx.to(t.device)))  # in place: the addresses stay

    def _buffers(self) -> list[torch.Tensor]:
        """The compressor rings, the entries and the step buffer, each once (no view of another)."""
        own = [e for name, e in self.entries.items() if not self._in_step_kv(name)]
        return [*self.ring_kv.values(), *self.ring_gate.values(), *own] + ([self.step_kv] if self.step_kv is not None
                                                                            else [])


def compress_static(layer: DsaV4StaticLayer, name: str, module, hidden_states: torch.Tensor, overlap: bool):
    """Compressor ``module`` (transformers' CSA / HCA compressor or CSA indexer) over the call's new tokens with
    ``layer``'s fixed buffers. Returns the entry rows [B, n_rows, D] and the count of closed windows (a 0-d int64
    tensor); runs after the layer's sliding update, whose counter already includes the new tokens."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    B, S, _ = hidden_states.shape
    rate, dim = module.compress_rate, module.head_dim
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)  # [B, S, F]
    ring_kv, ring_gate, entries = layer.compressor_buffers(name, kv, gate, dim)
    ring = ring_kv.shape[1]
    end = layer.cumulative_length
    start = end - S
    first_window = torch.div(start, rate, rounding_mode="floor")
    n_windows = (S + rate - 2) // rate + 1  # every window the new tokens can touch
    lead = 1 if overlap else 0  # the window before the first: its first half goes into the first entry
    pos = (first_window - lead) * rate + torch.arange((n_windows + lead) * rate, device=kv.device)
    new_row = pos - start
    is_new = (new_row >= 0) & (new_row < S)
    valid = is_new | ((pos >= 0) & (pos < start))  # the ring holds the 2 * rate tokens before `start`
    src = torch.where(is_new, ring + new_row, pos.remainder(ring))
    tok_kv = torch.cat([ring_kv, kv], dim=1).index_select(1, src)
    tok_gate = torch.cat([ring_gate, gate], dim=1).index_select(1, src)
    keep = min(S, ring)  # the ring takes the latest tokens after the gather read the older ones
    ring_rows = (start + torch.arange(S - keep, S, device=kv.device)).remainder(ring)
    ring_kv.index_copy_(1, ring_rows, kv[:, S - keep:])
    ring_gate.index_copy_(1, ring_rows, gate[:, S - keep:])

    shape = (B, n_windows + lead, rate, -1)
    slot_ok = valid.view(1, n_windows + lead, rate, 1)
    tok_kv = tok_kv.view(shape).masked_fill(~slot_ok, 0)
    tok_gate = (tok_gate.view(shape) + module.position_bias).masked_fill(~slot_ok, float("-inf"))
    if overlap:  # slots [window w-1's first half | window w's second half], as transformers lays them out
        new_kv = torch.cat([tok_kv[:, :-1, :, :dim], tok_kv[:, 1:, :, dim:]], dim=2)
        new_gate = torch.cat([tok_gate[:, :-1, :, :dim], tok_gate[:, 1:, :, dim:]], dim=2)
    else:
        new_kv, new_gate = tok_kv, tok_gate
    pooled = (new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2)
    # a window with no token yet (the bound above counts one more than some calls touch) pools 0/0: keep it finite
    touched = slot_ok[0, lead:, :, 0].any(-1).view(1, n_windows, 1)
    compressed = module.kv_norm(torch.where(touched, pooled, torch.zeros_like(pooled)))
    windows = first_window + torch.arange(n_windows, device=kv.device)
    positions = (windows * rate).unsqueeze(0).expand(B, -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type=module.rope_layer_type)
    compressed = apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    layer.write_entries(name, windows, compressed)
    return entries, torch.div(end, rate, rounding_mode="floor")


class DsaV4StaticCache(Cache):
    """A fixed-size cache for DeepSeek-V4 under ``dsa_tilelang`` (what ``generate(cache_implementation="static")``
    makes for V4 once ``dsa_plugins.hf`` is registered). ``config``: the V4 (text) config; ``max_cache_len``: the most
    tokens a sequence reaches; ``step_kv``: a generation step reads the window and the entries as one buffer (see
    :class:`DsaV4StaticLayer`; on)."""

    def __init__(self, config, max_cache_len: int, offloading: bool = False, step_kv: bool = True, **kwargs):
        if offloading:
            raise ValueError("DsaV4StaticCache: offloading is not supported (the compressor rings stay on the GPU)")
        rates = dict(getattr(config, "compress_rates", None) or {})
        window = getattr(config, "sliding_window", None)
        layers = []
        for i, kind in enumerate(config.layer_types):
            if kind == "sliding_attention":
                layers.append(DsaV4StaticLayer(max_cache_len, window))
            elif kind == "compressed_sparse_attention":
                layers.append(DsaV4StaticLayer(max_cache_len, window, rates[kind], ("compressor", "indexer"), step_kv))
            elif kind == "heavily_compressed_attention":
                layers.append(DsaV4StaticLayer(max_cache_len, window, rates[kind], ("compressor",), step_kv))
            else:
                raise ValueError(f"DsaV4StaticCache: layer {i} has type {kind!r}, which is not a DeepSeek-V4 "
                                 "attention layer type")
        super().__init__(layers=layers)  # the length: get_max_length(), as transformers' caches (5.17 has a
        # read-only max_cache_len property)

    def allocate(self, model, batch_size: int) -> None:
        """Make every buffer now, at fixed addresses, with the sizes and dtype of ``model``'s layers (a V4 causal LM
        or its base model). Needed when the prefill itself is compiled (``generate(..., prefill_chunk_size=...)``):
        buffers first made inside a compiled call get no fixed address, and CUDA graphs then copy or skip them."""
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        for i, layer in enumerate(self.layers):
            attn = decoder.layers[i].self_attn
            weight = attn.kv_proj.weight
            if not layer.is_initialized:
                fake = torch.zeros(batch_size, 1, 0, attn.head_dim, dtype=weight.dtype, device=weight.device)
                layer.lazy_initialization(fake, fake)
            comp = attn.compressor
            for name, module in (("compressor", comp), ("indexer", getattr(comp, "indexer", None))):
                if module is not None and name in layer.names:
                    fake = torch.zeros(batch_size, 0, module.kv_proj.out_features, dtype=weight.dtype,
                                       device=weight.device)
                    layer.compressor_buffers(name, fake, fake, module.head_dim)
