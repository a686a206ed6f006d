"""The catalogue of known variants, one record per (mechanism, variant): the port profile's vocabulary
(profile.py) and the index of the deviation library (diagnosis/deviations.py); bugs.py indexes the mutants
(mutants/) through these records.

A *mechanism* is one choice a port makes (its RoPE layout, its far logits, its never-empty rule, ...). Each
has a probe (probes.py): an input built so that only that mechanism, among those the probe lists, decides the
output. A *record* is one variant of a mechanism:

- ``description``: what the variant computes, as a port author reads it;
- ``model``: the ``deviations.Model`` subclass that implements it (None: the spec's own variant);
- ``mutant``: the class of a2ats_conformance.mutants that implements it in the MLX reference (None where only the
  model implements it: ``mutants.port_for(record)`` then builds a port from the model);
- ``source``: where it comes from (a SPEC.md clause, the authors' file:line, a port);
- ``kind``: ``spec`` (the spec's variant), ``authors`` (a choice of the authors' code that SPEC.md departs
  from) or ``port`` (a deviation seen in, or likely in, a port);
- ``group``: where the record has a mutant, its group: ``shipped``, ``coverage`` or ``gap`` (bugs.py says what
  each group's tests demand);
- ``clauses``: the clauses a port with this variant fails.

``catch_all`` marks a record that stands for "the output departs from the spec's by more than the tolerance,
by a rule no record predicts" (e.g. values quantized by a port's own codebook): it matches only when no other
record of a single-mechanism probe does.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from a2ats_conformance.diagnosis.deviations import Model, by_id
from a2ats_conformance.catalogue import variants as V
from a2ats_conformance.harness.adapter import FUNCTION_NAMES

__all__ = ["Mechanism", "Record", "MECHANISMS", "RECORDS", "records_of", "mechanism", "model_adapter"]


@dataclass(frozen=True)
class Mechanism:
    id: str
    title: str
    probe: str            # probes.PROBES key
    clauses: tuple        # the clauses a non-spec variant of it fails


@dataclass(frozen=True)
class Record:
    mechanism: str
    variant: str
    description: str
    model: type | None = None
    mutant: str | None = None
    source: str = ""
    kind: str = "port"
    group: str | None = None
    clauses: tuple = ()
    catch_all: bool = False
    deviation: str | None = None   # its id in deviations.DEVIATIONS, where the diagnosis library has it

    @property
    def key(self) -> str:
        return f"{self.mechanism}:{self.variant}"


def _dv(dev_id: str, name: str):
    """The variant class ``name`` of the deviation ``dev_id``."""
    for v in by_id(dev_id).variants:
        if v.__name__ == name:
            return v
    raise KeyError(f"deviation {dev_id!r} has no variant {name!r}")


def _precision_records(mech: str, what: str, source: str, *, float16_mutant=None, float16_group=None):
    """The spec's, float16 and bfloat16 variants of a LUT's precision (the float16-lut deviation's models)."""
    return (Record(mech, "spec", f"{what} at float32 accuracy or better", source="SPEC RET-LUT", kind="spec"),
            *(Record(mech, dt, f"{what} rounded to {dt}: near ties reorder", _dv("float16-lut", model),
                     mutant=mutant, source=f"port: {source} ({dt})", group=group, deviation="float16-lut")
              for dt, model, mutant, group in (("float16", "LutF16", float16_mutant, float16_group),
                                               ("bfloat16", "LutBF16", None, None))))


_CACHE_DECODE = ("RET-DECODE", "CACHE-DECODE", "CACHE-DENSE-EQUIV")

MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism("rope-layout", "RoPE layout", "rope", ("ROPE-APPLY", "ROPE-INVERSE", "EQ-10", "EQ-11", "EQ-12")),
    Mechanism("rope-positions", "RoPE positions", "rope", ("ROPE-APPLY", "ROPE-INVERSE", "EQ-12")),
    Mechanism("rope-freqs", "frequency table and scaling keys", "freqs", ("ROPE-FREQ",)),
    Mechanism("far-logits", "far logits", "far", ("EQ-11", "EQ-12")),
    Mechanism("far-position", "far position b", "far", ("EQ-11", "EQ-12")),
    Mechanism("window", "near/far window", "far", ("EQ-11",)),
    Mechanism("query-derotation", "far query de-rotation", "far", ("EQ-12",)),
    Mechanism("h-pooling", "H: GQA pooling", "moment", ("EQ-10",)),
    Mechanism("h-normalisation", "H: RMS normalisation", "moment", ("EQ-10",)),
    Mechanism("h-rb", "H: R_b on the queries", "moment", ("EQ-10",)),
    Mechanism("h-ridge", "H: ridge", "moment", ("EQ-10",)),
    Mechanism("assignment", "assignment rule", "assign", ("EQ-14", "EQ-16")),
    Mechanism("z-space", "z-space transform", "assign", ("EQ-16",)),
    Mechanism("key-derotation", "codes from pre- or post-RoPE keys", "far-keys", ("EQ-12", "CACHE-FAR-CODES")),
    Mechanism("topk-rounding", "top-k count rounding", "topk", ("RET-TOPK",)),
    Mechanism("topk-length", "top-k count: tokens counted", "select", ("RET-SELECT",)),
    Mechanism("gqa-union", "GQA union of the selection", "select", ("RET-SELECT",)),
    Mechanism("sinks", "sinks forced", "select", ("RET-SELECT",)),
    Mechanism("select-window", "selection window", "select", ("RET-SELECT",)),
    Mechanism("never-empty", "never-empty rule", "select", ("RET-SELECT",)),
    Mechanism("attention-keys", "keys attention reads", "decode-attend", _CACHE_DECODE + ("RET-ATTN",)),
    Mechanism("attention-query", "query attention reads", "decode-attend", _CACHE_DECODE),
    Mechanism("attention-scale", "attention scale", "decode-attend", _CACHE_DECODE),
    Mechanism("decode-position", "decode query position", "decode-attend", ("RET-DECODE",)),
    Mechanism("attention-values", "values attention reads", "decode-values", _CACHE_DECODE),
    Mechanism("attention-set", "selected set or multiset", "decode-select", _CACHE_DECODE + ("RET-ATTN",)),
    Mechanism("cache-codes", "codes the cache assigns", "cache-decode", ("CACHE-FAR-CODES",)),
    Mechanism("cache-values", "values the cache attends", "cache-values", ("CACHE-DECODE", "CACHE-DENSE-EQUIV")),
    Mechanism("selection-signal", "selection signal", "decode-select", _CACHE_DECODE + ("RET-LUT",)),
    Mechanism("decode-far-logits", "decode's LUT query", "decode-lut", _CACHE_DECODE + ("RET-LUT",)),
    Mechanism("lut-function-precision", "precision of lut_scores", "lut-ties", ("RET-LUT",)),
    Mechanism("lut-precision", "precision of the LUT the decode ranks", "decode-lut-ties", _CACHE_DECODE),
    Mechanism("kmeans-init", "k-means++ inverse CDF", "kmeans-init", ("EQ-17-INIT",)),
    Mechanism("empty-cluster", "k-means empty-cluster rule", "lloyd", ("EQ-17-STEP", "EQ-17-FIT")),
    Mechanism("kmeans-stop", "k-means stop rule", "kmeans", ("EQ-17-FIT",)),
    Mechanism("codes-dtype", "codes dtype", "codes-dtype", ("CODES-DTYPE", "CACHE-SAVE")),
    Mechanism("cache-trim", "cache state after trim", "cache-trim", ("CACHE-TRIM",)),
    Mechanism("cache-save", "cache state after save/load", "cache-save", ("CACHE-SAVE",)),
    Mechanism("cache-topk-length", "top-k count in the cache: tokens counted", "cache-topk",
              ("CACHE-DECODE", "CACHE-DENSE-EQUIV")),
)

_AUTHORS = "authors' code at 71f10b0"

RECORDS: tuple[Record, ...] = (
    # ---- RoPE
    Record("rope-layout", "spec", "pairs as the traditional flag says: (x[2i], x[2i+1]) or (x[i], x[i+d/2])",
           source="SPEC ROPE-APPLY", kind="spec"),
    Record("rope-layout", "swapped", "the traditional flag inverted: the other layout's pairs rotate together",
           _dv("rope-layout-swapped", "LayoutSwapped"), source="port: GGUF-permuted q/k read with the HF layout",
           deviation="rope-layout-swapped"),
    Record("rope-positions", "spec", "positions exact (float64 angles)", source="SPEC ROPE-APPLY", kind="spec"),
    Record("rope-positions", "float16", "positions rounded through float16 before the angle (3001 -> 3000)",
           _dv("positions-low-precision", "PosF16"), source="port: a position tensor in the model's dtype",
           deviation="positions-low-precision"),
    Record("rope-positions", "bfloat16", "positions rounded through bfloat16 before the angle (3001 -> 3008)",
           _dv("positions-low-precision", "PosBF16"), source="port: a position tensor in the model's dtype",
           deviation="positions-low-precision"),
    Record("rope-freqs", "spec", "mlx-lm's table: 'type' before 'rope_type'; llama3 defaults 1, 4, 8192",
           source="SPEC ROPE-FREQ", kind="spec"),
    Record("rope-freqs", "llama3-original-4096", "llama3: a left-out original_max_position_embeddings read as 4096",
           _dv("llama3-defaults", "Llama3L0"), source="port: HF-based llama3 config", deviation="llama3-defaults"),
    Record("rope-freqs", "llama3-high-2", "llama3: a left-out high_freq_factor read as 2",
           _dv("llama3-defaults", "Llama3High"), source="port: HF-based llama3 config", deviation="llama3-defaults"),
    Record("rope-freqs", "llama3-4096-and-2", "llama3: left-out original_max_position_embeddings 4096 and "
           "high_freq_factor 2", _dv("llama3-defaults", "Llama3L0High"), mutant="Llama3WrongDefaults",
           source="port: HF-based llama3 config", group="gap", deviation="llama3-defaults"),
    Record("rope-freqs", "rope-type-first", "'rope_type' read before 'type' (HF transformers' order)",
           _dv("rope-type-key-order", "RopeTypeFirst"), mutant="RopeTypeKeyOrder", source="port: HF transformers",
           group="gap", deviation="rope-type-key-order"),
    Record("rope-freqs", "type-only", "the scaling type read from 'type' only",
           _dv("rope-type-one-key", "TypeOnly"), source="port", deviation="rope-type-one-key"),
    Record("rope-freqs", "rope-type-only", "the scaling type read from 'rope_type' only",
           _dv("rope-type-one-key", "RopeTypeOnly"), source="port: HF transformers", deviation="rope-type-one-key"),
    # ---- far logits, b, window (EQ-11, EQ-12)
    Record("far-logits", "spec", "q·R_b·k: far tokens scored with the query at the far position b",
           source="SPEC EQ-11", kind="spec"),
    Record("far-logits", "exact", "exact RoPE q·R_(i−j)·k for far tokens too (no windowed RoPE)",
           _dv("far-logits-at-own-position", "OwnPosition"), source="port", deviation="far-logits-at-own-position"),
    Record("far-logits", "query-own-position", "q·R_i·k: the query at its own position, the key unrotated",
           V.QueryOwnPositionKeyUnrotated, source="port: re-rotation-free LUT over post-RoPE queries"),
    Record("far-logits", "unrotated", "q·k: far scores and H without R_b (b = 0)", _dv("b-missing", "BMissing"),
           source="port", deviation="b-missing"),
    Record("far-position", "spec", "b as given", source="SPEC EQ-11", kind="spec"),
    Record("far-position", "negated", "R_(−b): rope_invert where rope_apply is due", _dv("b-sign-flipped", "BNegated"),
           source="port", deviation="b-sign-flipped"),
    Record("far-position", "tied-to-w", "R_w used where the spec says R_b", _dv("b-tied-to-w", "BTiedToW"),
           mutant="BTiedToW", source="port", group="shipped", deviation="b-tied-to-w"),
    Record("far-position", "bfloat16", "b rounded through bfloat16 (3001 -> 3008)", _dv("b-low-precision", "BBF16"),
           source="port: b as a position tensor in the model's dtype", deviation="b-low-precision"),
    Record("far-position", "float16", "b rounded through float16 (3001 -> 3000)", _dv("b-low-precision", "BF16"),
           source="port: b as a position tensor in the model's dtype", deviation="b-low-precision"),
    Record("window", "spec", "near when i − j < w (every later key near)", source="SPEC EQ-11", kind="spec"),
    Record("window", "inclusive", "near when i − j <= w (off by one)", _dv("window-inclusive", "WindowInclusive"),
           mutant="WindowOffByOne", source="port", group="shipped", deviation="window-inclusive"),
    Record("window", "symmetric", "near when |i − j| < w", _dv("window-symmetric", "WindowSymmetric"),
           source="port", deviation="window-symmetric"),
    Record("query-derotation", "spec", "far_query(q_post, positions=i) = q_pre·R_b", source="SPEC EQ-12",
           kind="spec"),
    Record("query-derotation", "not-derotated", "the post-RoPE query times R_b (q_pre·R_(i+b))",
           _dv("query-not-derotated", "QueryNotDerotated"), source="port", deviation="query-not-derotated"),
    Record("query-derotation", "without-Rb", "far_query de-rotates but never rotates to b (q_pre, not q_pre·R_b)",
           V.FarQueryWithoutRb, source="port", deviation="b-missing"),
    # ---- H (EQ-10)
    Record("h-pooling", "spec", "every query head of the GQA group pooled (h // G)", source="SPEC EQ-10",
           kind="spec"),
    Record("h-pooling", "one-head", "one query head per group", _dv("h-one-head", "HOneHead"), mutant="HNotPooled",
           source="port", group="shipped", deviation="h-one-head"),
    Record("h-pooling", "strided", "heads g, g + n_kv, ... pooled (h % n_kv)", _dv("h-strided-groups", "HStrided"),
           source="port", deviation="h-strided-groups"),
    Record("h-normalisation", "spec", "H / sqrt(mean(H²))", source="SPEC EQ-10", kind="spec"),
    Record("h-normalisation", "raw", "H not RMS-normalised", _dv("h-not-normalised", "HRaw"), source="port",
           deviation="h-not-normalised"),
    Record("h-rb", "spec", "queries rotated by R_b", source="SPEC EQ-10", kind="spec"),
    Record("h-rb", "missing", "queries not rotated (b = 0)", _dv("b-missing", "BMissing"), source="port",
           deviation="b-missing"),
    Record("h-rb", "bfloat16", "b rounded through bfloat16 before R_b", _dv("b-low-precision", "BBF16"),
           mutant="QueryMomentBBfloat16", source="port", group="gap", deviation="b-low-precision"),
    Record("h-rb", "float16", "b rounded through float16 before R_b", _dv("b-low-precision", "BF16"), source="port",
           deviation="b-low-precision"),
    Record("h-rb", "negated", "queries rotated by R_(−b)", _dv("b-sign-flipped", "BNegated"), source="port",
           deviation="b-sign-flipped"),
    Record("h-ridge", "spec", "ridge·I added after the normalisation", source="SPEC EQ-10", kind="spec"),
    Record("h-ridge", "missing", "no ridge", _dv("ridge-missing", "RidgeMissing"), mutant="RidgeIgnored",
           source="port", group="gap", deviation="ridge-missing"),
    # ---- assignment (EQ-14, EQ-16)
    Record("assignment", "spec", "Eq. 14: argmin (k − c) H (k − c)ᵀ", source="SPEC EQ-14", kind="spec"),
    Record("assignment", "plain", "plain ‖k − c‖² (H and L ignored)", V.PlainAssignment,
           source="port: VQ without the query-aware metric"),
    Record("assignment", "cosine-blend", "½·cos − ½·‖k − c‖² / (1 + max‖k − c‖²)",
           _dv("cosine-blend", "CosineBlend1"), mutant="CosineBlend", source="port: VeloxQuant-MLX",
           group="shipped", deviation="cosine-blend"),
    Record("assignment", "cosine-blend-0", "½·cos − ½·‖k − c‖² / max‖k − c‖²", _dv("cosine-blend", "CosineBlend0"),
           source="port: VeloxQuant-MLX", deviation="cosine-blend"),
    Record("z-space", "spec", "z = k L", source="SPEC EQ-16", kind="spec"),
    Record("z-space", "transposed", "z = k Lᵀ", _dv("l-transposed", "LTransposed"), mutant="LTransposed",
           source="port", group="shipped", deviation="l-transposed"),
    Record("key-derotation", "spec", "each key de-rotated at its own position (pre-RoPE codes)", source="SPEC EQ-12",
           kind="spec"),
    Record("key-derotation", "post-rope", "the post-RoPE key coded as it is",
           _dv("codes-from-post-rope-keys", "PostRopeKeys"), mutant="FarKeysRotated", source="port",
           group="shipped", deviation="codes-from-post-rope-keys"),
    Record("key-derotation", "scalar-position", "a block de-rotated by its first token's position",
           _dv("derotate-scalar-position", "ScalarDerotation"), mutant="DerotateScalarOffset",
           source="port: mx.fast.rope(offset=-p0)", group="shipped", deviation="derotate-scalar-position"),
    # ---- top-k and selection (RET-TOPK, RET-SELECT)
    Record("topk-rounding", "spec", "int(topk · T), float64 product", source="SPEC RET-TOPK", kind="spec"),
    Record("topk-rounding", "ceil", "ceil(topk · T)", _dv("topk-rounded-up", "TopkCeil"), mutant="TopkCeil",
           source="port", group="shipped", deviation="topk-rounded-up"),
    Record("topk-rounding", "float32", "int(float32(topk) · float32(T)) (PyTorch's promotion)",
           _dv("topk-float32", "TopkFloat32"), mutant="TopkFloat32",
           source="SPEC RET-TOPK, Departures; authors vqkey/models/llama_masked.py:206,220", kind="authors", group="gap",
           deviation="topk-float32"),
    Record("topk-length", "spec", "counted over the i + 1 tokens the query sees", source="SPEC RET-SELECT",
           kind="spec"),
    Record("topk-length", "over-T", "counted over the whole score row (T)", _dv("topk-over-T", "TopkOverT"),
           source="port", deviation="topk-over-T"),
    Record("topk-length", "over-candidates", "counted over the candidates (less sinks and window)",
           _dv("topk-over-candidates", "TopkOverCandidates"), mutant="TopkOverCandidates", source="port",
           group="gap", deviation="topk-over-candidates"),
    Record("gqa-union", "spec", "union of the top-k of every head of the group", source="SPEC RET-SELECT",
           kind="spec"),
    Record("gqa-union", "one-head", "the first head of each group selects", _dv("gqa-one-head", "OneHeadVotes"),
           mutant="UnionMissing", source="port", group="shipped", deviation="gqa-one-head"),
    Record("gqa-union", "head-zero-ranks", "every head ranks by query head 0", _dv("gqa-one-head", "HeadZeroRanks"),
           source="port", deviation="gqa-one-head"),
    Record("gqa-union", "strided", "groups strided (h % n_kv)", _dv("gqa-strided-groups", "StridedGroups"),
           source="port", deviation="gqa-strided-groups"),
    Record("sinks", "spec", "the first `sinks` tokens always selected", source="SPEC RET-SELECT", kind="spec"),
    Record("sinks", "not-forced", "sinks compete as candidates", _dv("sinks-not-forced", "SinksNotForced"),
           source="port", deviation="sinks-not-forced"),
    Record("select-window", "spec", "window 0 <= i − j < w always selected", source="SPEC RET-SELECT", kind="spec"),
    Record("select-window", "inclusive", "window i − j <= w (one token wider)", _dv("window-inclusive",
           "WindowInclusive"), source="port", deviation="window-inclusive"),
    Record("never-empty", "spec", "the query's own token when sinks, window and top-k select nothing",
           source="SPEC RET-SELECT", kind="spec"),
    Record("never-empty", "beside-sinks", "the own token added whenever the count is 0, sinks or not",
           _dv("never-empty-beside-sinks", "OwnTokenAtCountZero"), mutant="OwnTokenAtCountZero", source="port",
           group="gap", deviation="never-empty-beside-sinks"),
    Record("never-empty", "nothing", "nothing selected (a softmax over an empty set)", V.AuthorsNothingSelected,
           source="SPEC RET-SELECT, 'Our choice: the never-empty rule'; authors vqkey/models/llama_masked.py:220,228-231",
           kind="authors", clauses=("RET-SELECT", "RET-DECODE")),
    # ---- decode: what attention reads (RET-DECODE)
    Record("attention-keys", "spec", "exact keys of the selected tokens", source="SPEC RET-DECODE", kind="spec"),
    Record("attention-keys", "quantized", "quantized keys C[code]·R_t (compression only, no retrieval)",
           _dv("quantized-keys-in-attention", "QuantizedKeys"), mutant="CompressionOnly",
           source="port: VeloxQuant-MLX", group="shipped", deviation="quantized-keys-in-attention"),
    Record("attention-query", "spec", "the query at its own position i", source="SPEC RET-DECODE", kind="spec"),
    Record("attention-query", "far-position", "the query at the far position b (relative position b − j)",
           _dv("far-query-in-attention", "FarQueryAttention"), mutant="FarQueryInAttention",
           source="SPEC 'Where we depart from the authors'; authors vqkey/models/llama.py:268,324-331",
           kind="authors", group="shipped", deviation="far-query-in-attention"),
    Record("attention-scale", "spec", "the caller's scale, 1/sqrt(d) when None", source="SPEC RET-DECODE",
           kind="spec"),
    Record("attention-scale", "ignored", "always 1/sqrt(d)", _dv("attention-scale-wrong", "ScaleIgnored"),
           mutant="DecodeIgnoresScale", source="port: Gemma's query_pre_attn_scalar dropped", group="gap",
           deviation="attention-scale-wrong"),
    Record("attention-scale", "over-d", "1/d by default", _dv("attention-scale-wrong", "ScaleOverD"), source="port",
           deviation="attention-scale-wrong"),
    Record("decode-position", "spec", "the query at query_pos", source="SPEC RET-DECODE", kind="spec"),
    Record("decode-position", "last-token", "the query at T − 1 (from the keys' length)",
           _dv("decode-query-at-last-token", "QueryAtLastToken"), mutant="DecodeQueryAtLastToken", source="port",
           group="gap", deviation="decode-query-at-last-token"),
    Record("attention-values", "spec", "exact values", source="SPEC RET-DECODE", kind="spec"),
    Record("attention-values", "float16", "values rounded through float16", _dv("values-quantized", "ValuesF16"),
           source="port: fp16 value cache", deviation="values-quantized"),
    Record("attention-values", "bfloat16", "values rounded through bfloat16", _dv("values-quantized", "ValuesBF16"),
           source="port: bf16 value cache", deviation="values-quantized"),
    Record("attention-values", "int8", "values quantized to 8 bits per token (absmax)",
           _dv("values-quantized", "ValuesInt8"), source="port: int8 value cache", deviation="values-quantized"),
    Record("attention-values", "quantized", "values changed by a lossy rule of the port's own (e.g. vector-quantized "
           "values): attention's output departs from exact values", catch_all=True, source="port"),
    Record("attention-set", "spec", "each selected token attended once", source="SPEC RET-ATTN", kind="spec"),
    Record("attention-set", "duplicates", "a forced token also picked by top-k attended twice",
           _dv("duplicate-tokens", "Duplicates"), source="port", deviation="duplicate-tokens"),
    Record("cache-codes", "spec", "each appended key de-rotated at its own position, then Eq. 16",
           source="SPEC CACHE-FAR-CODES", kind="spec"),
    Record("cache-codes", "post-rope", "the cache codes post-RoPE keys", _dv("codes-from-post-rope-keys",
           "PostRopeKeys"), source="port", deviation="codes-from-post-rope-keys"),
    Record("cache-codes", "scalar-position", "the cache de-rotates a chunk by its first position",
           _dv("derotate-scalar-position", "ScalarDerotation"), source="port", deviation="derotate-scalar-position"),
    Record("cache-values", "spec", "exact values", source="SPEC CACHE-DECODE", kind="spec"),
    Record("cache-values", "float16", "the cache holds values in float16", _dv("values-quantized", "ValuesF16"),
           source="port: fp16 value cache", deviation="values-quantized"),
    Record("cache-values", "bfloat16", "the cache holds values in bfloat16", _dv("values-quantized", "ValuesBF16"),
           source="port: bf16 value cache", deviation="values-quantized"),
    Record("cache-values", "int8", "the cache holds 8-bit values (absmax per token)",
           _dv("values-quantized", "ValuesInt8"), source="port: int8 value cache", deviation="values-quantized"),
    Record("cache-values", "quantized", "the cache changes values by a lossy rule of its own (e.g. vector-quantized "
           "values)", catch_all=True, source="port"),
    Record("selection-signal", "spec", "tokens scored with the true query", source="SPEC RET-LUT", kind="spec"),
    Record("selection-signal", "key-proxy", "tokens scored with the newest key standing in for the query",
           _dv("key-as-proxy-query", "ProxyQuery"), source="port: VeloxQuant-MLX", deviation="key-as-proxy-query"),
    Record("selection-signal", "none", "no selection: every visible token attended", V.NoSelection,
           source="port: dense attention behind the cache"),
    Record("decode-far-logits", "spec", "LUT of q_post·R_(b−i) (= q_pre·R_b) times the codebook",
           source="SPEC RET-LUT", kind="spec"),
    Record("decode-far-logits", "not-derotated", "LUT of q_post·R_b (q_pre·R_(i+b))",
           _dv("query-not-derotated", "QueryNotDerotated"), mutant="LutPostRopeQuery", source="port", group="gap",
           deviation="query-not-derotated"),
    Record("decode-far-logits", "exact", "scores q_post·(C[code]·R_t): the codeword re-rotated at its position",
           _dv("far-logits-at-own-position", "OwnPosition"), source="port: VeloxQuant-MLX (re-rotates every key)",
           deviation="far-logits-at-own-position"),
    Record("decode-far-logits", "query-own-position", "LUT of q_post (q·R_i·k, no de-rotation, no R_b)",
           V.QueryOwnPositionKeyUnrotated, source="port"),
    *_precision_records("lut-function-precision", "lut_scores", "a half-precision LUT"),
    *_precision_records("lut-precision", "the LUT the decode ranks (q_b and C, or its scores)",
                        "a half-precision LUT kernel", float16_mutant="Float16Lut", float16_group="coverage"),
    # ---- k-means (EQ-17)
    Record("kmeans-init", "spec", "smallest n with cumsum(D²)[n] > u·ΣD²", source="SPEC EQ-17-INIT", kind="spec"),
    Record("kmeans-init", "inclusive", ">= (searchsorted side='left'): u = 0 re-picks a chosen point",
           _dv("kmeanspp-cdf-inclusive", "CdfInclusive"), mutant="KmeansppSearchsortedLeft", source="port",
           group="gap", deviation="kmeanspp-cdf-inclusive"),
    Record("empty-cluster", "spec", "the worst-served point of a cluster with >= 2 members moves in (lowest index)",
           source="SPEC EQ-17-STEP", kind="spec"),
    Record("empty-cluster", "tie-highest", "ties go to the highest point index",
           _dv("empty-cluster-tie-highest", "TieHighest"), mutant="EmptyClusterTieHighIndex", source="port",
           group="gap", deviation="empty-cluster-tie-highest"),
    Record("empty-cluster", "stale-sizes", "donors judged by the sizes before any move",
           _dv("empty-cluster-stale-sizes", "StaleSizes"), mutant="EmptyClusterStaleCounts", source="port",
           group="gap", deviation="empty-cluster-stale-sizes"),
    Record("empty-cluster", "zero", "an empty cluster's centre collapses to the zero vector", V.AuthorsEmptyZero,
           source="SPEC EQ-17-STEP, Departures; authors vqkey/kmeans-gpu/kmeans_gpu/kmeans.py:110-114",
           kind="authors"),
    Record("kmeans-stop", "spec", "relative objective decrease below tol", source="SPEC EQ-17-FIT", kind="spec"),
    Record("kmeans-stop", "absolute", "centroid shift ‖C_s − C_(s−1)‖_F below tol", V.AuthorsAbsoluteStop,
           mutant="KmeansCentroidShiftStop",
           source="SPEC EQ-17-FIT, Departures; authors vqkey/kmeans-gpu/kmeans_gpu/kmeans.py:116-124", kind="authors",
           group="gap"),
    # ---- codes and cache state
    Record("codes-dtype", "spec", "code_dtype(K): uint8 up to 256, uint16 up to 65536", source="SPEC CODES-DTYPE",
           kind="spec"),
    Record("codes-dtype", "int64", "int64 whatever K (torch.argmin's output)", V.AuthorsInt64Codes,
           source="SPEC CODES-DTYPE; authors vqkey/models/llama_masked.py:168", kind="authors"),
    Record("cache-trim", "spec", "trim drops the trimmed tokens' codes and rolls back the position counter",
           source="SPEC CACHE-TRIM", kind="spec"),
    Record("cache-trim", "keeps-codes", "trimmed tokens' codes kept for the tokens written in their place",
           _dv("trim-keeps-codes", "TrimKeepsCodes"), source="port", deviation="trim-keeps-codes"),
    Record("cache-trim", "keeps-counter", "the position counter that codes later tokens not rolled back",
           _dv("trim-keeps-position-counter", "TrimKeepsCounter"), mutant="TrimForgetsPositions", source="port",
           group="shipped", deviation="trim-keeps-position-counter"),
    Record("cache-save", "spec", "save/load keeps every token and parameter", source="SPEC CACHE-SAVE", kind="spec"),
    *(Record("cache-save", f"resets-{p}", f"load resets {p} to the default {shown}",
             _dv("load-resets-parameter", f"LoadResets_{p}"), mutant=m, source="port",
             group="gap" if m else None, deviation="load-resets-parameter")
      for p, shown, m in (("w", "64", "SaveDropsWindow"), ("b", "2048", "SaveDropsB"), ("sinks", "8", None),
                          ("topk", "0.03", None), ("scale", "1/sqrt(d)", None))),
)

RECORDS += (
    Record("cache-topk-length", "spec", "counted over the i + 1 tokens the query sees, whatever the buffer holds",
           source="SPEC CACHE-DECODE", kind="spec"),
    Record("cache-topk-length", "over-buffer", "counted over the cache's allocated buffer (grown 256 tokens at a time)",
           _dv("topk-over-buffer", "TopkOverBuffer"), source="port: the count taken from the KV buffer's size",
           deviation="topk-over-buffer"),
)

_BY_MECH: dict[str, list[Record]] = {}
for _r in RECORDS:
    _BY_MECH.setdefault(_r.mechanism, []).append(_r)
_MECH = {m.id: m for m in MECHANISMS}
assert set(_BY_MECH) == set(_MECH), "every mechanism has records and every record a mechanism"
assert all(rs[0].kind == "spec" and rs[0].model is None for rs in _BY_MECH.values()), "the spec's variant first"
assert len({r.key for r in RECORDS}) == len(RECORDS), "one record per (mechanism, variant)"


def records_of(mech_id: str) -> list[Record]:
    return list(_BY_MECH[mech_id])


def mechanism(mech_id: str) -> Mechanism:
    return _MECH[mech_id]


def record_clauses(r: Record) -> tuple:
    return r.clauses or _MECH[r.mechanism].clauses


def model_adapter(model_cls):
    """An adapter whose callables are ``model_cls()``'s (the faithful model with None), in float64."""

    m = (model_cls or Model)()
    ns = SimpleNamespace(name=f"model {type(m).__name__}", version="model", dtypes=("float64",))
    for fn in FUNCTION_NAMES + ("make_cache",):
        setattr(ns, fn, getattr(m, fn))
    return ns
