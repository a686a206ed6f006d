"""Mutant ports: the reference adapter with one realistic bug each.  The suite must reject every
one of them, on the clause the bug violates (tests/suite/test_mutants.py proves it).

Run one by hand:  a2ats-conformance --iut a2ats_conformance.mutants:FarKeysRotated --clauses EQ-12

Several are the departures of VeloxQuant-MLX's "A2ATS-adapted" port listed in DESIGN.md
(cosine-blend assignment, attention over quantized keys); the others are the bugs a port is
likely to have (off-by-one window, one-offset de-rotation, transposed factor, ...).

The mutants live by clause area: ``base.py`` (``Mutant`` and shared helpers), ``rope.py`` (ROPE-*), ``wrope.py``
(EQ-11, EQ-12), ``assignment.py`` (EQ-13, EQ-14), ``calibration.py`` (EQ-10, EQ-15 to EQ-18, k-means),
``retrieval.py`` (RET-*), ``prefill.py`` (PREFILL), ``cache.py`` (CACHE-*, CODES-DTYPE) and ``cache_paths.py``
(the cache's fast_rope, host decode and host prefill paths). This package gathers them in three sets, in the
order tests and diagnosis draw them.
"""

from __future__ import annotations

from a2ats_conformance.mutants.base import Mutant
from a2ats_conformance.mutants.rope import (Llama3WrongDefaults, RopeScalarAsOffset, RopeTruncatesRealPositions,
                                            RopeInvertFirstRowPositions, RopeTypeKeyOrder, RopeUnsupportedAsLinear,
                                            RopeCutsLongPositions)
from a2ats_conformance.mutants.wrope import (DerotateScalarOffset, WindowOffByOne, BTiedToW, FarKeysRotated,
                                             WropeDefaultRightAligned, FarQueryScalarAsOffset, FarKeysFlattenedHeads)
from a2ats_conformance.mutants.assignment import (CosineBlend, AssignCodesSaturate255, AssignSymmetrisesH)
from a2ats_conformance.mutants.calibration import (LTransposed, HNotPooled, RidgeIgnored, KmeansppSearchsortedLeft,
                                                   EmptyClusterTieHighIndex, EmptyClusterStaleCounts,
                                                   ZTransformBatchedFirstL, BackTransformBatchedFirstL,
                                                   AssignZCodesUint8, CholeskyLooseSymmetry, QueryMomentBBfloat16,
                                                   QueryMomentEpsNormalise, AssignZLeadingRowZero,
                                                   KmeansCentroidShiftStop, KmeansCodesOfLastStep,
                                                   KmeansFirstBlockBias)
from a2ats_conformance.mutants.retrieval import (TopkCeil, UnionMissing, CompressionOnly, FarQueryInAttention,
                                                 Float16Lut, TopkFloat32, SelectClampsQueryPos, TokenScoresClipsCodes,
                                                 DecodeClampsQueryPos, DecodeWrapsCodes, DecodeIgnoresScale,
                                                 LutPostRopeQuery, TopkOverCandidates, SelectBatchedStridedGroups,
                                                 TopkOneIsAFraction, OwnTokenAtCountZero, DecodeQueryAtLastToken,
                                                 AttentionEmptyRowAverages, AttentionBatchRowZeroMask,
                                                 GroupUnionFirst8Heads, Float16ScaleDropped)
from a2ats_conformance.mutants.prefill import (PrefillPositiveAxes, CollectionStridedGroups)
from a2ats_conformance.mutants.cache import (TrimForgetsPositions, BatchRowsReadRowZero, PositionsLowPrecision,
                                             ChunkRerotated, CacheIgnoresScale, HalfCacheIgnoresScale,
                                             CacheCodesU16At256, TrimKeepsCodeCounts, TrimZeroClears, SaveDropsWindow,
                                             SaveDropsB, BatchedPrefillRowZero, SaveBatchRowZero, PositionsOneBased,
                                             CodesWidenOnGrowth, DecodeSkipsPendingCodes, StaleQueryAngle,
                                             LoadKeepsCallerOffset, SaveKeepsTrimmedTokens, BatchOneSqueezed,
                                             CacheFloat16LutOperand)
from a2ats_conformance.mutants.cache_paths import (HostPathHeadZero, FastRopeCodesPostRope,
                                                   FastRopeBatchFirstPosition, FastRopeTraditionalIgnored,
                                                   FastRopePositionsBfloat16, FastRopeQueryAngleNext,
                                                   HostTopkOneTiedTooFew, HostPrefillStartAligned)

__all__ = ["MUTANTS", "COVERAGE_MUTANTS", "GAP_MUTANTS", "Mutant", "Llama3WrongDefaults", "RopeScalarAsOffset",
           "RopeTruncatesRealPositions", "RopeInvertFirstRowPositions", "RopeTypeKeyOrder", "RopeUnsupportedAsLinear",
           "RopeCutsLongPositions", "DerotateScalarOffset", "WindowOffByOne", "BTiedToW", "FarKeysRotated",
           "WropeDefaultRightAligned", "FarQueryScalarAsOffset", "FarKeysFlattenedHeads", "CosineBlend",
           "AssignCodesSaturate255", "AssignSymmetrisesH", "LTransposed", "HNotPooled", "RidgeIgnored",
           "KmeansppSearchsortedLeft", "EmptyClusterTieHighIndex", "EmptyClusterStaleCounts",
           "ZTransformBatchedFirstL", "BackTransformBatchedFirstL", "AssignZCodesUint8", "CholeskyLooseSymmetry",
           "QueryMomentBBfloat16", "QueryMomentEpsNormalise", "AssignZLeadingRowZero", "KmeansCentroidShiftStop",
           "KmeansCodesOfLastStep", "KmeansFirstBlockBias", "TopkCeil", "UnionMissing", "CompressionOnly",
           "FarQueryInAttention", "Float16Lut", "TopkFloat32", "SelectClampsQueryPos", "TokenScoresClipsCodes",
           "DecodeClampsQueryPos", "DecodeWrapsCodes", "DecodeIgnoresScale", "LutPostRopeQuery", "TopkOverCandidates",
           "SelectBatchedStridedGroups", "TopkOneIsAFraction", "OwnTokenAtCountZero", "DecodeQueryAtLastToken",
           "AttentionEmptyRowAverages", "AttentionBatchRowZeroMask", "GroupUnionFirst8Heads", "Float16ScaleDropped",
           "PrefillPositiveAxes", "CollectionStridedGroups", "TrimForgetsPositions", "BatchRowsReadRowZero",
           "PositionsLowPrecision", "ChunkRerotated", "CacheIgnoresScale", "HalfCacheIgnoresScale",
           "CacheCodesU16At256", "TrimKeepsCodeCounts", "TrimZeroClears", "SaveDropsWindow", "SaveDropsB",
           "BatchedPrefillRowZero", "SaveBatchRowZero", "PositionsOneBased", "CodesWidenOnGrowth",
           "DecodeSkipsPendingCodes", "StaleQueryAngle", "LoadKeepsCallerOffset", "SaveKeepsTrimmedTokens",
           "BatchOneSqueezed", "CacheFloat16LutOperand", "HostPathHeadZero", "FastRopeCodesPostRope",
           "FastRopeBatchFirstPosition", "FastRopeTraditionalIgnored", "FastRopePositionsBfloat16",
           "FastRopeQueryAngleNext", "HostTopkOneTiedTooFew", "HostPrefillStartAligned"]

#: name -> mutant class (each names its expected_clause and bug)
MUTANTS = {cls.__name__: cls for cls in (
    DerotateScalarOffset, WindowOffByOne, BTiedToW, FarKeysRotated, LTransposed, HNotPooled, CosineBlend,
    TopkCeil, UnionMissing, CompressionOnly, TrimForgetsPositions,
    FarQueryInAttention,
)}

# --------------------------------------------------------------------------- coverage mutants
# Bugs in code paths a suite can easily leave unreached: each names the coverage property that kills it
# (tests/suite/test_coverage_mutants.py proves the kill on its clause).

#: name -> coverage mutant: each reaches a path a thin suite misses, and is killed on expected_clause
COVERAGE_MUTANTS = {cls.__name__: cls for cls in (
    Float16Lut, BatchRowsReadRowZero, PositionsLowPrecision, HostPathHeadZero, ChunkRerotated,
)}

# --------------------------------------------------------------------------- gap mutants
# Bugs a port writer makes that pass a suite which only draws the easy cases. Each class names the clause that
# must reject it (expected_clause), the property that does (gap: "file::test"), and, where the diagnosis
# catalogue has it, the known deviation its failure must name (expected_cause, an id of
# conformance/diagnosis/deviations.py).

#: name -> gap mutant, grouped by the easy draws each passed
GAP_MUTANTS = {cls.__name__: cls for cls in (
    # EQ-10 and EQ-17 (query moment, k-means)
    RidgeIgnored, KmeansppSearchsortedLeft, EmptyClusterTieHighIndex, EmptyClusterStaleCounts,
    # ROPE-FREQ, RET-TOPK and INPUT-ERRORS
    Llama3WrongDefaults, TopkFloat32, SelectClampsQueryPos, TokenScoresClipsCodes, DecodeClampsQueryPos,
    DecodeWrapsCodes,
    # the decode scale and the cache (RET-DECODE, CACHE-*, CODES-DTYPE)
    DecodeIgnoresScale, CacheIgnoresScale, HalfCacheIgnoresScale, CacheCodesU16At256, TrimKeepsCodeCounts,
    TrimZeroClears,
    # diagnosis gaps (the failure named no cause, or the wrong one)
    LutPostRopeQuery, TopkOverCandidates, SaveDropsWindow, SaveDropsB,
    # EQ-13 to EQ-18
    ZTransformBatchedFirstL, BackTransformBatchedFirstL, AssignZCodesUint8, AssignCodesSaturate255,
    CholeskyLooseSymmetry, AssignSymmetrisesH,
    # batched selection and batched prefill
    SelectBatchedStridedGroups, BatchedPrefillRowZero, SaveBatchRowZero,
    # ROPE-APPLY and ROPE-INVERSE positions
    RopeScalarAsOffset, RopeTruncatesRealPositions, RopeInvertFirstRowPositions,
    # RoPE and EQ-10..12: bugs that pass a suite in which b is only ever drawn at values bfloat16 holds exactly,
    # far_keys/far_query and wrope_scores only on 2-D inputs with explicit (T,) positions, the two scaling-type keys
    # never disagreed, and the INPUT-ERRORS of RoPE, EQ-10 and ROPE-FREQ were barely probed
    RopeTypeKeyOrder, QueryMomentBBfloat16, WropeDefaultRightAligned, FarQueryScalarAsOffset, FarKeysFlattenedHeads,
    RopeUnsupportedAsLinear, RopeCutsLongPositions, QueryMomentEpsNormalise,
    # EQ-13..18 and retrieval: bugs that pass a suite drawing only the common shapes and counts; the eight below
    # guard: leading dims, the k-means stop rule and returned codes, the int top-k count 1, the never-empty rule beside
    # sinks, a query before the last token, an empty selection, batched attention
    AssignZLeadingRowZero, KmeansCentroidShiftStop, KmeansCodesOfLastStep, TopkOneIsAFraction, OwnTokenAtCountZero,
    DecodeQueryAtLastToken, AttentionEmptyRowAverages, AttentionBatchRowZeroMask,
    # the cache: bugs that pass a suite in which positions() is never checked against the rule, codes' dtype checked
    # only before the buffers grow, decodes checked only after codes() had coded every token and only once per cache,
    # load always called on the cache that saved, batch = 1 and batched prefill inputs never drawn
    PositionsOneBased, CodesWidenOnGrowth, StaleQueryAngle, LoadKeepsCallerOffset, SaveKeepsTrimmedTokens,
    BatchOneSqueezed, PrefillPositiveAxes,
    # what users have: GQA groups past 8 heads, k-means past one 512-row block, half-precision inputs; each passed
    # the suite whose draws stopped at groups of 3 heads, 40 k-means points and float32 inputs by default
    GroupUnionFirst8Heads, KmeansFirstBlockBias, Float16ScaleDropped, CacheFloat16LutOperand,
    # the path make_a2ats_cache builds (the model's own RoPE: fast_rope, angle tables), the host decode path and the
    # host attention kernels (prefill through the hook, calibration's collection)
    FastRopeCodesPostRope, FastRopeBatchFirstPosition, FastRopeTraditionalIgnored, FastRopePositionsBfloat16,
    FastRopeQueryAngleNext, HostTopkOneTiedTooFew, HostPrefillStartAligned, CollectionStridedGroups,
)}
