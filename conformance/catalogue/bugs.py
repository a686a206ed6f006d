"""The catalogue's index of mutant ports: one entry per class of a2ats_conformance.mutants, saying which bug it
plants, which clause must reject it and which property does.

An entry whose mutant implements a catalogue record (the record names it; the entry's ``record`` is then that
record's "mechanism:variant") takes its description, its known deviation and its group from that record, so the
bug is described once. The other entries are implementation bugs that belong to no mechanism of the port
profile (a batch row, a dtype, a code path), and carry their own:

- ``group``: ``shipped`` (the twelve a port is most likely to have; the failure must name ``cause`` first),
  ``coverage`` (a path a thin suite leaves unreached; the failure must name ``cause``), ``gap`` (passes a suite
  that draws only the easy cases; the failure must name ``cause`` where one is given);
- ``clause``: the clause that must reject it; ``prop``: the property ("file::test") written for it, which must
  reject it (every gap mutant has one; a coverage mutant where one property covers its path);
- ``cause``: the id of the known deviation (diagnosis/deviations.py) its failure must name;
- ``coverage_item``: the path a coverage mutant reaches; ``half_precision``: its bug shows only at float16 or
  bfloat16, so its run keeps the whole dtype matrix.

The mutants package reads its groups and each class's ``expected_clause``, ``bug``, ``gap``, ``expected_cause``
from here; tests/suite/test_mutants.py, test_coverage_mutants.py and test_gap_mutants.py prove each entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from a2ats_conformance.catalogue import RECORDS

__all__ = ["Bug", "BUGS", "GROUPS", "bug", "of_group"]

GROUPS = ("shipped", "coverage", "gap")
_RECORD_OF = {r.mutant: r for r in RECORDS if r.mutant is not None}


@dataclass(frozen=True)
class Bug:
    mutant: str
    clause: str
    group: str | None = None
    description: str = ""
    cause: str | None = None
    prop: str | None = None
    coverage_item: str | None = None
    half_precision: bool = False
    record: str | None = field(default=None, init=False)   # the key of the record naming this mutant, if one does

    def __post_init__(self):
        r = _RECORD_OF.get(self.mutant)
        if r is not None:
            assert self.group is None and not self.description and self.cause is None, \
                f"{self.mutant}: group, description and cause come from record {r.key}"
            for name, value in (("record", r.key), ("group", r.group), ("description", r.description),
                                ("cause", r.deviation)):
                object.__setattr__(self, name, value)
        assert self.group in GROUPS, f"{self.mutant}: group {self.group!r}"
        assert self.description, f"{self.mutant}: no description"


BUGS: tuple[Bug, ...] = (
    # ---- shipped
    Bug('DerotateScalarOffset', clause='EQ-12'),
    Bug('WindowOffByOne', clause='EQ-11'),
    Bug('BTiedToW', clause='EQ-11'),
    Bug('FarKeysRotated', clause='EQ-12'),
    Bug('LTransposed', clause='EQ-16'),
    Bug('HNotPooled', clause='EQ-10'),
    Bug('CosineBlend', clause='EQ-14'),
    Bug('TopkCeil', clause='RET-TOPK'),
    Bug('UnionMissing', clause='RET-SELECT'),
    Bug('CompressionOnly', clause='RET-DECODE'),
    Bug('TrimForgetsPositions', clause='CACHE-TRIM'),
    Bug('FarQueryInAttention', clause='RET-DECODE'),
    # ---- coverage
    Bug('Float16Lut', clause='RET-DECODE', coverage_item='near ties'),
    Bug('BatchRowsReadRowZero', clause='CACHE-BATCH', group='coverage', description="batched decode: every row uses row 0's token selection", cause='batch-rows-share-row-zero-selection', prop='test_cache.py::test_batched_decode_rows', coverage_item='CACHE-BATCH'),
    Bug('PositionsLowPrecision', clause='CACHE-FAR-CODES', group='coverage', description='token positions held in bfloat16 when keys are de-rotated for their codes (wrong past position 256)', cause='positions-low-precision', prop='test_cache.py::test_long_positions', coverage_item='positions'),
    Bug('HostPathHeadZero', clause='CACHE-DECODE', group='coverage', description="host selection path (>= HOST_SELECT_MIN candidates) ranks every head of a GQA group by the first head's scores", cause='gqa-one-head', prop='test_cache.py::test_host_selection_path', coverage_item='host selection'),
    Bug('ChunkRerotated', clause='CACHE-CHUNK', group='coverage', description="chunked prefill: keys of every chunk after the first stored re-rotated by the chunk's offset", cause='chunk-keys-rerotated', prop='test_cache.py::test_chunked_prefill', coverage_item='CACHE-CHUNK'),
    # ---- gap
    # EQ-10 and EQ-17 (query moment, k-means)
    Bug('RidgeIgnored', clause='EQ-10', prop='test_eq10_query_moment.py::test_query_moment_matches_oracle'),
    Bug('KmeansppSearchsortedLeft', clause='EQ-17-INIT', prop='test_eq17_kmeans.py::test_kmeanspp_init_on_cdf_boundaries'),
    Bug('EmptyClusterTieHighIndex', clause='EQ-17-STEP', prop='test_eq17_kmeans.py::test_lloyd_step_empty_clusters_with_exact_ties'),
    Bug('EmptyClusterStaleCounts', clause='EQ-17-STEP', prop='test_eq17_kmeans.py::test_lloyd_step_empty_clusters_with_exact_ties'),
    # ROPE-FREQ, RET-TOPK and INPUT-ERRORS
    Bug('Llama3WrongDefaults', clause='ROPE-FREQ', prop='test_rope.py::test_llama3_left_out_keys_take_the_defaults'),
    Bug('TopkFloat32', clause='RET-TOPK', prop='test_retrieval.py::test_topk_count_matches_oracle'),
    Bug('SelectClampsQueryPos', clause='INPUT-ERRORS', group='gap', description='select_tokens clamps query_pos into [0, T - 1] instead of raising ValueError', prop='test_input_errors.py::test_select_tokens_rejects_query_pos_out_of_range'),
    Bug('TokenScoresClipsCodes', clause='INPUT-ERRORS', group='gap', description='token_scores gathers with clipped indices (mx.take does no bounds check): a code >= K reads LUT[K - 1]', prop='test_input_errors.py::test_token_scores_rejects_codes_out_of_range'),
    Bug('DecodeClampsQueryPos', clause='INPUT-ERRORS', group='gap', description="decode_step clamps query_pos into [0, T - 1] (the cache's length) instead of raising ValueError", prop='test_input_errors.py::test_decode_step_rejects_query_pos_out_of_range'),
    Bug('DecodeWrapsCodes', clause='INPUT-ERRORS', group='gap', description='decode_step reduces codes modulo K (a wrapping gather) instead of raising ValueError on codes outside [0, K)', prop='test_input_errors.py::test_decode_step_rejects_codes_out_of_range'),
    # the decode scale and the cache (RET-DECODE, CACHE-*, CODES-DTYPE)
    Bug('DecodeIgnoresScale', clause='RET-DECODE', prop='test_retrieval.py::test_decode_step_matches_oracle'),
    Bug('CacheIgnoresScale', clause='CACHE-DECODE', group='gap', description="the cache's decode ignores config['scale'] (always 1/sqrt(d))", cause='attention-scale-wrong', prop='test_cache.py::test_decode_matches_oracle'),
    Bug('HalfCacheIgnoresScale', clause='CACHE-DECODE', group='gap', description="the cache's float16 decode branch ignores config['scale'] (float32 decodes are right)", prop='test_cache.py::test_decode_matches_oracle', half_precision=True),
    Bug('CacheCodesU16At256', clause='CODES-DTYPE', group='gap', description='cache stores codes as uint8 only for K < 256 (K = 256 gets uint16); code_dtype() itself is right', prop='test_cache.py::test_cache_codes_dtype'),
    Bug('TrimKeepsCodeCounts', clause='CACHE-TRIM', group='gap', description='trim rolls back keys, values, codes and offset but not the per-code counts the sort-free (GPU) top-k walks', prop='test_cache.py::test_trim_rollback'),
    Bug('TrimZeroClears', clause='CACHE-TRIM', group='gap', description='trim slices buffers with [:-n]; trim(0) (speculative decoding, every draft accepted) empties the cache', prop='test_cache.py::test_trim_rollback'),
    # diagnosis gaps (the failure named no cause, or the wrong one)
    Bug('LutPostRopeQuery', clause='RET-DECODE', prop='test_retrieval.py::test_decode_step_matches_oracle'),
    Bug('TopkOverCandidates', clause='RET-SELECT', prop='test_retrieval.py::test_select_tokens_is_an_allowed_selection'),
    Bug('SaveDropsWindow', clause='CACHE-SAVE', prop='test_cache.py::test_save_load_roundtrip'),
    Bug('SaveDropsB', clause='CACHE-SAVE', prop='test_cache.py::test_save_load_roundtrip'),
    # EQ-13 to EQ-18
    Bug('ZTransformBatchedFirstL', clause='EQ-16', group='gap', description='z_transform with a per-head stack L (n_kv, d, d) uses L[0] for every head', prop='test_eq15_eq16_eq18.py::test_z_transform_per_head_L'),
    Bug('BackTransformBatchedFirstL', clause='EQ-18', group='gap', description='back_transform with a per-head stack L (n_kv, d, d) solves every head with L[0]', prop='test_eq15_eq16_eq18.py::test_back_transform_per_head_L'),
    Bug('AssignZCodesUint8', clause='EQ-16', group='gap', description='assign_z returns uint8 codes (the 256-entry sub-vector habit): codes of K > 256 codebooks wrap modulo 256', prop='test_eq15_eq16_eq18.py::test_assign_z_large_codebook'),
    Bug('AssignCodesSaturate255', clause='EQ-14', group='gap', description='assign stores codes in uint8 with a saturating cast (np.minimum(codes, 255)): codes >= 256 read as 255', prop='test_eq13_eq14_assign.py::test_assign_large_codebook'),
    Bug('CholeskyLooseSymmetry', clause='INPUT-ERRORS', group='gap', description='cholesky calls H symmetric up to |H - Hᵀ| <= 1e-3 * max(1, max|H|) (np.allclose-style) and symmetrises it', prop='test_input_errors.py::test_slightly_asymmetric_H'),
    Bug('AssignSymmetrisesH', clause='INPUT-ERRORS', group='gap', description='assign never checks that H is symmetric: it uses (H + Hᵀ)/2, so an asymmetric H is silently accepted', prop='test_input_errors.py::test_slightly_asymmetric_H'),
    # batched selection and batched prefill
    Bug('SelectBatchedStridedGroups', clause='RET-SELECT', group='gap', description='select_tokens on scores with leading dims groups query heads strided (h % n_kv, a tile for a repeat) instead of h // G; (n_q, T) scores are grouped right', cause='gqa-strided-groups', prop='test_retrieval.py::test_select_tokens_is_an_allowed_selection'),
    Bug('BatchedPrefillRowZero', clause='CACHE-BATCH', group='gap', description="batched prefill attends every row's queries to row 0's keys and values (k[:1] broadcast over the batch)", prop='test_cache.py::test_batched_decode_rows'),
    Bug('SaveBatchRowZero', clause='CACHE-SAVE', group='gap', description="save of a batched cache keeps row 0 only (keys[0]); load gives every row row 0's keys, values and codes", cause='load-keeps-row-zero', prop='test_cache.py::test_save_load_batched_rows'),
    # ROPE-APPLY and ROPE-INVERSE positions
    Bug('RopeScalarAsOffset', clause='ROPE-APPLY', group='gap', description="a scalar position is taken as mx.fast.rope's offset: token t rotated by p + t instead of p", prop='test_rope.py::test_rope_apply_matches_oracle'),
    Bug('RopeTruncatesRealPositions', clause='ROPE-APPLY', group='gap', description='positions cast to int before the angle (astype(int32)): real positions 2.5 -> 2, -1.5 -> -1', prop='test_rope.py::test_rope_apply_matches_oracle'),
    Bug('RopeInvertFirstRowPositions', clause='ROPE-INVERSE', group='gap', description="rope_invert takes positions as one (T,) vector: a (B, T) positions array uses row 0's for every row", prop='test_rope.py::test_rope_invert_matches_oracle'),
    # RoPE and EQ-10..12: bugs that pass a suite in which b is only ever drawn at values bfloat16 holds exactly,
    # far_keys/far_query and wrope_scores only on 2-D inputs with explicit (T,) positions, the two scaling-type keys
    # never disagreed, and the INPUT-ERRORS of RoPE, EQ-10 and ROPE-FREQ were barely probed
    Bug('RopeTypeKeyOrder', clause='ROPE-FREQ', prop='test_rope.py::test_inv_freqs_type_key_read_first'),
    Bug('QueryMomentBBfloat16', clause='EQ-10', prop='test_eq10_query_moment.py::test_query_moment_matches_oracle'),
    Bug('WropeDefaultRightAligned', clause='EQ-11', group='gap', description='positions left out: queries right-aligned to the keys (Tk - Tq + arange(Tq), as in a decode) instead of arange(Tq)', prop='test_eq11_eq12_wrope.py::test_wrope_scores_leading_dims_and_default_positions'),
    Bug('FarQueryScalarAsOffset', clause='EQ-12', group='gap', description='far_query takes an int position as an offset (mx.fast.rope style): query head h moved by b - (p + h)', prop='test_eq11_eq12_wrope.py::test_far_side_leading_dims_and_position_forms'),
    Bug('FarKeysFlattenedHeads', clause='EQ-12', group='gap', description="far_keys flattens (n_kv, T, d) to rows and pairs them with np.repeat(positions, n_kv) (np.tile is the right order): heads' keys de-rotated at other tokens' positions", prop='test_eq11_eq12_wrope.py::test_far_side_leading_dims_and_position_forms'),
    Bug('RopeUnsupportedAsLinear', clause='INPUT-ERRORS', group='gap', description='unsupported scaling types (yarn, dynamic, longrope, ...) built as linear with their factor, not rejected', prop='test_input_errors.py::test_rope_inv_freqs_rejects_unsupported_types'),
    Bug('RopeCutsLongPositions', clause='INPUT-ERRORS', group='gap', description='positions longer than the T rows silently cut to their last T (positions[-T:], a cache idiom)', prop='test_input_errors.py::test_rotation_rejects_bad_positions_and_inv_freqs'),
    Bug('QueryMomentEpsNormalise', clause='INPUT-ERRORS', group='gap', description='H / (rms + 1e-12): a KV group whose queries are all zero gets ridge*I instead of a ValueError', prop='test_input_errors.py::test_query_moment_rejects_bad_input'),
    # EQ-13..18 and retrieval: bugs that pass a suite drawing only the common shapes and counts; the eight below
    # guard: leading dims, the k-means stop rule and returned codes, the int top-k count 1, the never-empty rule beside
    # sinks, a query before the last token, an empty selection, batched attention
    Bug('AssignZLeadingRowZero', clause='EQ-16', group='gap', description='assign_z with keys (..., T, d) (several heads or sequences) codes the first row and broadcasts its codes', prop='test_eq15_eq16_eq18.py::test_assign_z_leading_dims'),
    Bug('KmeansCentroidShiftStop', clause='EQ-17-FIT', prop='test_eq17_kmeans.py::test_kmeans_fit'),
    Bug('KmeansCodesOfLastStep', clause='EQ-17-FIT', group='gap', description="kmeans returns the last Lloyd step's codes (nearest to C_(s−1)) instead of nearest(z, C_s) of the returned C", prop='test_eq17_kmeans.py::test_kmeans_fit'),
    Bug('TopkOneIsAFraction', clause='RET-TOPK', group='gap', description='topk_count tests `topk <= 1` for a fraction: the int 1 (one token) is read as 1.0, all T tokens', prop='test_retrieval.py::test_topk_count_matches_oracle'),
    Bug('OwnTokenAtCountZero', clause='RET-SELECT', prop='test_retrieval.py::test_select_tokens_is_never_empty'),
    Bug('DecodeQueryAtLastToken', clause='RET-DECODE', prop='test_retrieval.py::test_decode_step_query_before_the_last_token'),
    Bug('AttentionEmptyRowAverages', clause='INPUT-ERRORS', group='gap', description='retrieval_attention fills unselected logits with -1e9: a KV head that selects nothing averages all its values instead of raising ValueError', prop='test_input_errors_b.py::test_retrieval_and_codebook_inputs_are_checked'),
    Bug('AttentionBatchRowZeroMask', clause='RET-ATTN', group='gap', description="retrieval_attention with leading dims applies the first row's mask to every row (mask[0] broadcast)", prop='test_retrieval.py::test_retrieval_attention_matches_oracle'),
    # the cache: bugs that pass a suite in which positions() is never checked against the rule, codes' dtype checked
    # only before the buffers grow, decodes checked only after codes() had coded every token and only once per cache,
    # load always called on the cache that saved, batch = 1 and batched prefill inputs never drawn
    Bug('PositionsOneBased', clause='CACHE-TRIM', group='gap', description='positions() reports 1 .. offset instead of 0 .. offset - 1 (both caches of the trim test agreed)', prop='test_cache.py::test_trim_rollback'),
    Bug('CodesWidenOnGrowth', clause='CODES-DTYPE', group='gap', description='codes buffer grown past 256 tokens with int32 zeros (concatenate promotes): codes int32 from token 257 on', prop='test_cache.py::test_cache_codes_dtype'),
    Bug('DecodeSkipsPendingCodes', clause='CACHE-DECODE', group='gap', description='lazily coded tokens are coded by codes() but not by decode, which scores them as code 0', cause='decode-scores-uncoded', prop='test_cache.py::test_generation_steps'),
    Bug('StaleQueryAngle', clause='CACHE-DECODE', group='gap', description="the far query's de-rotation angle cached at the first decode: every later decode scores as at that position", cause='query-angle-stale', prop='test_cache.py::test_generation_steps'),
    Bug('LoadKeepsCallerOffset', clause='CACHE-SAVE', group='gap', description="load() takes the offset of the cache it is called on, not the file's: a fresh cache loads an empty cache", prop='test_cache.py::test_save_load_roundtrip'),
    Bug('SaveKeepsTrimmedTokens', clause='CACHE-SAVE', group='gap', description='save() writes tokens up to a high-water mark trim does not lower: trimmed draft tokens come back on load', prop='test_cache.py::test_save_load_roundtrip'),
    Bug('BatchOneSqueezed', clause='CACHE-BATCH', group='gap', description='a batched cache with batch = 1 returns its arrays without the leading batch axis (squeezed)', prop='test_cache.py::test_batched_decode_rows'),
    Bug('PrefillPositiveAxes', clause='PREFILL', group='gap', description='prefill_attention reads Tq, Tk as q.shape[1], k.shape[1] (written for 3-D inputs): with a leading batch axis the causal mask is aligned by n_kv - n_q instead of Tk - Tq', prop='test_prefill_codes.py::test_prefill_attention_matches_oracle'),
    # what users have: GQA groups past 8 heads, k-means past one 512-row block, half-precision inputs; each passed
    # the suite whose draws stopped at groups of 3 heads, 40 k-means points and float32 inputs by default
    Bug('GroupUnionFirst8Heads', clause='RET-SELECT', group='gap', description="the GQA union keeps an 8-lane head mask: in groups of 9-16 query heads only the first 8 heads' top-k count", prop='test_retrieval.py::test_select_tokens_is_an_allowed_selection'),
    Bug('KmeansFirstBlockBias', clause='EQ-17-STEP', group='gap', description="Lloyd assignment over more than one 512-row block adds ||c||^2 twice to the first block's distances (a pipelined block prefetch that also adds the norms): rows 0..511 are pulled to small codewords", prop='test_eq17_kmeans.py::test_lloyd_step_matches_oracle'),
    Bug('Float16ScaleDropped', clause='RET-ATTN', group='gap', description='with float16 inputs (a separate half-precision kernel) retrieval attention ignores an explicit scale and uses 1/sqrt(d)', prop='test_retrieval.py::test_retrieval_attention_matches_oracle'),
    Bug('CacheFloat16LutOperand', clause='CACHE-DECODE', group='gap', description="the cache's LUT operand (C transposed) held in float16: the decode ranks near ties by float16 codewords", cause='float16-lut', prop='test_cache_near_ties.py::test_cache_decode_near_ties'),
    # the path make_a2ats_cache builds (the model's own RoPE: fast_rope, angle tables), the host decode path and the
    # host attention kernels (prefill through the hook, calibration's collection)
    Bug('FastRopeCodesPostRope', clause='CACHE-FAR-CODES', group='gap', description="with the model's own RoPE (fast_rope), codes are assigned from the post-RoPE keys (no de-rotation)", prop='test_cache.py::test_decode_matches_oracle'),
    Bug('FastRopeBatchFirstPosition', clause='CACHE-FAR-CODES', group='gap', description="with the model's own RoPE, every key of a coding batch is de-rotated at the batch's first position", prop='test_cache.py::test_decode_matches_oracle'),
    Bug('FastRopeTraditionalIgnored', clause='CACHE-FAR-CODES', group='gap', description="with the model's own RoPE, keys are de-rotated in the half-split layout whatever `traditional` says", prop='test_cache.py::test_codes_do_not_depend_on_position'),
    Bug('FastRopePositionsBfloat16', clause='CACHE-FAR-CODES', group='gap', description="with the model's own RoPE, key positions pass through bfloat16 before the de-rotation (wrong past 256)", prop='test_cache.py::test_long_positions'),
    Bug('FastRopeQueryAngleNext', clause='CACHE-DECODE', group='gap', description="with the model's own RoPE, the decode query is de-rotated at offset (the next token), not offset - 1", prop='test_cache.py::test_decode_matches_oracle'),
    Bug('HostTopkOneTiedTooFew', clause='CACHE-DECODE', group='gap', description="host top-k (>= HOST_SELECT_MIN candidates) takes one token too few of a tie at a head's k-th score", prop='test_cache.py::test_host_selection_path'),
    Bug('HostPrefillStartAligned', clause='CACHE-CHUNK', group='gap', description="host prefill (>= HOST_PREFILL_MIN query x key pairs, through the hook) masks queries start-aligned: a later chunk's query t sees keys <= t instead of <= offset + t", prop='test_cache.py::test_long_prefill_chunks'),
    Bug('CollectionStridedGroups', clause='PREFILL', group='gap', description="calibration's collection attention groups query heads strided: head h reads KV head h % n_kv, not h // G", prop='test_prefill_codes.py::test_collection_attention_matches_oracle'),
)

_BY_NAME = {b.mutant: b for b in BUGS}
assert len(_BY_NAME) == len(BUGS), "one entry per mutant"
assert set(_RECORD_OF) <= set(_BY_NAME), "every record's mutant has its entry"


def bug(name: str) -> Bug:
    return _BY_NAME[name]


def of_group(group: str) -> list[Bug]:
    return [b for b in BUGS if b.group == group]
