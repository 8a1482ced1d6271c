"""What a model's attention looks like to gmtool, read from the model itself rather than from config fields it
may ignore.

- `attention_refusal(model)`, on a model built on the meta device (no weights): attention modules whose forward
  does not go through transformers' AttentionInterface (gmtool's attention would never be called), recurrent
  state, non-causal attention, and keys the module picks or pools itself (sparse or compressed attention).
- `probe_layout(lm)`: one tiny forward with every attention call recorded instead of computed: the KV layout the
  cache needs (kv heads, K and V head dims) and each layer's options (window, soft-cap, sinks); a mask the module
  made itself is refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from gmtool.errors import GmtoolError, first_line
from gmtool.model import attention, families
from gmtool.model.attention import LayerOpts

# what transformers passes an attention function that gmtool reads, or may ignore because gmtool's attention
# computes it another way (positions and lengths come from gmtool's own metadata)
READ_KWARGS = {"sliding_window", "softcap", "s_aux"}
IGNORED_KWARGS = {
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "use_cache",
    "cache_position",
    "output_attentions",
    "is_causal",
    "layer_idx",
    "dropout",
    "head_mask",
    "position_embeddings",
    "past_key_values",
    "cache",
    "return_dict",
}


@dataclass(frozen=True)
class KVLayout:
    num_heads: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    layers: tuple[LayerOpts, ...]

    @property
    def windows(self) -> list[int | None]:
        return [o.window for o in self.layers]

    def features(self) -> list[str]:
        """The attention features beyond plain causal attention that this model uses, in words."""
        out = []
        windows = sorted({w for w in self.windows if w is not None})
        if windows:
            which = (
                "every layer"
                if None not in self.windows
                else f"{sum(w is not None for w in self.windows)} of {len(self.layers)} layers"
            )
            out.append(f"sliding window {'/'.join(map(str, windows))} on {which}")
        if any(o.softcap is not None for o in self.layers):
            out.append("logit soft-cap")
        if any(o.sinks is not None for o in self.layers):
            out.append("attention sinks")
        if self.k_head_dim != self.v_head_dim:
            out.append(f"K/V head dims {self.k_head_dim}/{self.v_head_dim}")
        return out


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers would route through an attention function: one per decoder layer."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


# Module class names of layers that carry a recurrent state (or a convolution's window) across steps: gmtool's
# paged KV cache holds none of it, so eager and graphs would agree on something the model does not compute.
STATEFUL_LAYERS = (
    "Mamba",
    "Mixer",
    "DeltaNet",
    "LinearAttention",
    "ShortConv",
    "Rwkv",
    "RWKV",
    "xLSTM",
    "RecurrentBlock",
    "Rglru",
    "Lightning",
)


# Parts of an attention module that choose or make the keys each query sees, beyond its causal window: the
# attention function is handed keys (and a mask) that the module computed from state gmtool's cache does not hold.
KEY_SELECTION = {
    "Indexer": "sparse attention: a top-k indexer ({}) picks the keys each query attends to",
    "Compressor": "compressed K/V: a compressor ({}) pools blocks of past tokens into extra keys",
}


def _kv_refusal(arch: str, mods: list[torch.nn.Module]) -> str | None:
    """What the attention modules do to their keys that gmtool's paged cache cannot: pick or pool them, or
    take them all from another model."""
    for m in mods:
        for part in m.modules():
            feature = next((f for w, f in KEY_SELECTION.items() if w in type(part).__name__), None)
            if feature:
                return (
                    f"{arch}: its attention ({type(m).__name__}) needs {feature.format(type(part).__name__)}; "
                    "gmtool's attention does not implement it"
                )
    # a layer that reuses K/V keeps none of its own; gmtool's cache holds the copy it is handed, which is exact
    # while a layer of this model stores it (Gemma 3n), and nothing when every layer reuses another model's
    if all(getattr(m, "is_kv_shared_layer", False) for m in mods):
        return (
            f"{arch}: every layer attends to K/V another model computed (a speculative-decoding assistant), "
            "so it has no KV cache of its own for gmtool to page"
        )
    return None


def attention_refusal(arch: str, model: torch.nn.Module) -> str | None:
    """Why gmtool's attention would not be the model's (read from the attention classes' source)."""
    stateful = sorted(
        {
            type(m).__name__
            for m in model.modules()  # a causal conv keeps its last inputs as state
            if any(w in type(m).__name__ for w in STATEFUL_LAYERS) or isinstance(m, torch.nn.Conv1d)
        }
    )
    if stateful:
        return (
            f"{arch} has recurrent or convolutional layers ({', '.join(stateful[:3])}) whose state gmtool's "
            "paged KV cache does not hold"
        )
    mods = _attention_modules(model)
    if not mods:
        classes = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        return (
            f"{arch}: its attention ({', '.join(classes) or 'no attention module'}) does not go through "
            "transformers' AttentionInterface, so gmtool cannot route it to its paged KV cache"
        )
    for cls in {type(m) for m in mods}:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if "ALL_ATTENTION_FUNCTIONS" not in src and "attention_interface" not in src:
            return (
                f"{arch}: its attention ({cls.__name__}) does not go through transformers' AttentionInterface, "
                "so gmtool cannot route it to its paged KV cache"
            )
    if why := _kv_refusal(arch, mods):
        return why
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, name, False) is True for name in ("alibi", "use_alibi")):
        # falcon's ALiBi configs (transformers 5.25 routes its attention through the interface): the bias rides in
        # the mask transformers builds, and the probe's forward, given no mask, fails before saying so
        return (
            f"{arch}: ALiBi position biases (config alibi=True), which transformers adds to the attention scores "
            "through the mask and gmtool's attention does not apply"
        )
    noncausal = sorted({type(m).__name__ for m in mods if getattr(m, "is_causal", True) is False})
    if noncausal:
        return (
            f"{arch} has non-causal attention ({', '.join(noncausal)}: an encoder's or cross-attention), and "
            "gmtool's paged attention is causal"
        )
    return None


def _probe_tokens(lm) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ordinary tokens from mid-vocabulary and their positions: not padding (a zero embedding hides what the
    LM head does) and not the special ids at either end (image placeholders, ...)."""
    device = next(lm.model.parameters()).device
    return torch.arange(2, device=device) + lm.vocab_size // 2, torch.arange(2, device=device)


def split_refusal(lm, tp: int) -> str | None:
    """Why the model split over tp ranks (gmtool.parallel.shard) cannot run, from the probe's two tokens through
    it: a family whose layers read the whole head count (OLMo 2's q/k norms over every head, StableLM's reshape by
    its num_heads) fails, or calls its attention with other than this rank's heads, on every rank alike and before
    any collective: said in one line, not as a raw torch error in the sweep."""
    ids, pos = _probe_tokens(lm)
    with attention.probing([]) as calls, torch.no_grad():
        try:
            lm.forward_logits(ids, pos, pos[-1:])
        except (RuntimeError, ValueError) as e:
            why = first_line(e, typed=True)[:180]
            return f"--tp {tp}: {lm.name}'s layers do not run split over ranks ({why}): run it with --tp 1"
    split = {(q[1], k[1], v[1]) for _, q, k, v, _, _ in calls}
    if split != {(lm.rank_heads, lm.rank_kv_heads, lm.rank_kv_heads)}:
        h, kh, vh = sorted(split)[0]
        return (
            f"--tp {tp}: {lm.name}'s attention gets {h} query and {kh}/{vh} K/V heads a rank, not {lm.rank_heads} "
            f"and {lm.rank_kv_heads}: its layers do not split by heads (a norm or reshape over every head); run it "
            "with --tp 1"
        )
    return None


def probe_layout(lm, arch: str) -> KVLayout:
    """Run two tokens through the model with the attention calls recorded: one call per layer, each with the
    layer's q/k/v shapes and options."""
    ids, pos = _probe_tokens(lm)
    with attention.probing([]) as calls, torch.no_grad():
        try:
            logits = lm.forward_logits(ids, pos, pos[-1:])
        except Exception as e:  # noqa: BLE001 (any failure of a foreign model's forward is said in one line)
            raise GmtoolError(
                f"{arch}: its forward failed on a 2-token probe: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            ) from None
    layers = [m.layer_idx for m, *_ in calls]
    if sorted(layers) != list(range(lm.num_layers)):
        missing = sorted(set(range(lm.num_layers)) - set(layers))
        stack = families.decoder_layers(lm.model, lm.num_layers)
        kinds = f" ({', '.join(sorted({type(stack[i]).__name__ for i in missing}))})" if stack is not None else ""
        raise GmtoolError(
            f"{arch}: "
            + (
                f"layers {missing}{kinds} have no attention that goes through transformers' AttentionInterface"
                if missing
                else f"each layer calls its attention {len(layers) // lm.num_layers} times (on "
                "one token stream), which gmtool's one KV cache per layer cannot hold"
            )
        )
    masked = sorted({type(m).__name__ for m, *_, kw in calls if kw["attention_mask"] is not None})
    if masked:
        raise GmtoolError(
            f"{arch}: its attention ({', '.join(masked)}) adds a mask it computes itself to the scores (a dynamic "
            "or learned mask), which gmtool's attention does not apply"
        )
    shapes = {(q[1], k[1], q[2], k[2], v[2]) for _, q, k, v, _, _ in calls}
    if len(shapes) != 1:
        said = "; ".join(
            f"{h} heads over {kvh} kv heads, q/k/v head dims {qd}/{kd}/{vd}" for h, kvh, qd, kd, vd in sorted(shapes)
        )
        raise GmtoolError(
            f"{arch}: its layers differ in attention shape ({said}): gmtool's KV cache has one layout for every layer"
        )
    heads, kv_heads, qd, kd, vd = shapes.pop()
    if qd != kd or heads % kv_heads:
        raise GmtoolError(
            f"{arch}: {heads} query heads of dim {qd} against {kv_heads} kv heads of dim {kd}: "
            "gmtool's attention needs whole query groups over K of the query's dim"
        )
    unknown = sorted(
        {
            k
            for *_, kw in calls
            for k, v in kw.items()
            if k not in READ_KWARGS | IGNORED_KWARGS and v is not None and v is not False
        }
    )
    if unknown:
        raise GmtoolError(
            f"{arch}: its attention asks for {', '.join(unknown)}, which gmtool's attention does not implement"
        )
    if why := _logits_refusal(lm, arch, ids, pos, logits):
        raise GmtoolError(why)
    opts = [None] * lm.num_layers
    for m, *_, kw in calls:
        opts[m.layer_idx] = LayerOpts.from_kwargs(kw)
    return KVLayout(heads, kv_heads, kd, vd, tuple(opts))


def _logits_refusal(lm, arch: str, ids, pos, ours: torch.Tensor) -> str | None:
    """gmtool's forward (base model, output embeddings on the rows it needs, gmtool.model.families' logit rule)
    against the causal LM's own forward, on the probe's tokens with attention still recorded as zeros: both see
    the same hidden states, so any difference is what the LM's forward does after them that gmtool's does not."""
    kwargs = dict(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    with attention.probing([]), torch.no_grad():
        try:
            try:  # the LM head on the last row only, as gmtool's: the same GEMM shape, the same rounding
                theirs = lm.model(**kwargs, logits_to_keep=1).logits[0, -1:]
            except TypeError:
                theirs = lm.model(**kwargs).logits[0, -1:]
        except Exception:  # noqa: BLE001 (a forward that needs more than token ids, a drafter's: nothing to compare)
            return None
    if not torch.isfinite(theirs).all():  # the model's own forward, not a rule gmtool's lacks: say which it is
        why = (
            "activations past float16's range, or NaN weights: try --dtype bf16"
            if theirs.dtype == torch.float16
            else "NaN or infinite weights, or a norm dividing by zero: check its weights and config"
        )
        dtype = str(theirs.dtype).removeprefix("torch.")
        return f"{arch}: its own forward gives non-finite logits in {dtype} on a probe of {ids.numel()} tokens ({why})"
    err = (ours.float() - theirs.float()).abs().max().item() if ours.shape == theirs.shape else float("inf")
    # rounding's share: a few units in the last place of the largest logit. What this catches is far larger: a
    # logit scale, a head, or a soft-cap (x^3 / 3cap^2: 3e-5 of a logit of 0.3 under Gemma 2's cap of 30)
    if err <= 64 * torch.finfo(ours.dtype).eps * max(1.0, theirs.float().abs().max().item()):
        return None
    base, out = families.base_model(lm.model), lm.model.get_output_embeddings()
    heads = [
        f"{n}: {type(m).__name__}"
        for n, m in lm.model.named_children()
        if m is not out and not any(s is base for s in m.modules()) and any(True for _ in m.parameters())
    ]
    what = (
        f"a head before its output embeddings ({', '.join(heads)})"
        if heads
        else "a rule to its logits that gmtool.model.families does not list"
    )
    return f"{arch}: its causal LM's forward applies {what}: gmtool's logits differ from it by {err:.1e} on a probe"
