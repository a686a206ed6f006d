"""Mutant ports: the reference adapter with one realistic bug each.  The suite must reject every
one of them, on the clause the bug violates (tests/suite/test_mutants.py, test_coverage_mutants.py and
test_gap_mutants.py prove it).

What each mutant plants, the clause and property that must reject it, its group and the known deviation its
failure names are catalogue data (a2ats_conformance.catalogue.bugs, through the catalogue's records where the
mutant implements one); this package sets them on each class as ``expected_clause``, ``bug``, ``gap``,
``expected_cause``, ``coverage_item`` and ``half_precision``.

Run one by hand:  a2ats-conformance --iut a2ats_conformance.mutants:FarKeysRotated --clauses EQ-12

Several are the departures of VeloxQuant-MLX's "A2ATS-adapted" port listed in DESIGN.md
(cosine-blend assignment, attention over quantized keys); the others are the bugs a port is
likely to have (off-by-one window, one-offset de-rotation, transposed factor, ...).

The mutants live by clause area: ``base.py`` (``Mutant`` and shared helpers), ``rope.py`` (ROPE-*), ``wrope.py``
(EQ-11, EQ-12), ``assignment.py`` (EQ-13, EQ-14), ``calibration.py`` (EQ-10, EQ-15 to EQ-18, k-means),
``retrieval.py`` (RET-*), ``prefill.py`` (PREFILL), ``cache.py`` (CACHE-*, CODES-DTYPE) and ``cache_paths.py``
(the cache's fast_rope, host decode and host prefill paths). This package gathers them in three sets, in the
catalogue's order, which tests and diagnosis draw them in.
"""

from __future__ import annotations

from a2ats_conformance.catalogue import model_adapter
from a2ats_conformance.catalogue.bugs import BUGS, of_group
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

__all__ = ["MUTANTS", "COVERAGE_MUTANTS", "GAP_MUTANTS", "Mutant", "port_for", "Llama3WrongDefaults", "RopeScalarAsOffset",
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


def _annotated(entry):
    cls = globals()[entry.mutant]
    cls.expected_clause, cls.bug, cls.expected_cause = entry.clause, entry.description, entry.cause
    cls.gap, cls.coverage_item, cls.half_precision = entry.prop, entry.coverage_item, entry.half_precision
    cls.record = entry.record
    return cls


#: name -> mutant class: the bugs a port is most likely to have; each failure names its known deviation first
MUTANTS = {b.mutant: _annotated(b) for b in of_group("shipped")}
#: name -> coverage mutant: each reaches a path a thin suite misses (``coverage_item``), killed on expected_clause
COVERAGE_MUTANTS = {b.mutant: _annotated(b) for b in of_group("coverage")}
#: name -> gap mutant: each passed a suite drawing only the easy cases, and is killed by the property ``gap``
GAP_MUTANTS = {b.mutant: _annotated(b) for b in of_group("gap")}
assert {b.mutant for b in BUGS} == set(__all__) - {"MUTANTS", "COVERAGE_MUTANTS", "GAP_MUTANTS", "Mutant", "port_for"}, \
    "every mutant class has its catalogue entry (catalogue/bugs.py), and every entry its class"


def port_for(record):
    """A port with exactly the catalogue record's variant: its mutant class when it has one, else the record's model
    as a float64 adapter (catalogue.model_adapter)."""
    if record.mutant is not None:
        return globals()[record.mutant]()
    return model_adapter(record.model)
