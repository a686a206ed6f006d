"""Mutants of retrieval (RET-LUT, RET-TOPK, RET-SELECT, RET-ATTN, RET-DECODE, and the INPUT-ERRORS of
select_tokens, token_scores, decode_step and retrieval_attention): the top-k count, the GQA union, the LUT query,
the attention over the selected set and the decode step."""

from __future__ import annotations

import math

import numpy as np

from a2ats_spec import oracle as _o

from a2ats_conformance.mutants.base import Mutant, _np


class TopkCeil(Mutant):
    def topk_count(self, T, topk, n_candidates=None):
        if isinstance(topk, float):
            n = int(math.ceil(topk * T))
            return n if n_candidates is None else min(n, n_candidates)
        return self._ref.topk_count(T, topk) if n_candidates is None else self._ref.topk_count(T, topk, n_candidates)


class UnionMissing(Mutant):
    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        G = s.shape[-2] // n_kv_heads
        return self._ref.select_tokens(s[..., ::G, :], n_kv_heads=n_kv_heads, **kw)


class CompressionOnly(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        out, mask = self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                          topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=scale,
                                          return_mask=True)
        c = np.asarray(codes).astype(np.int64)
        Cq = _np(C)[np.arange(c.shape[-2])[:, None], c]                   # (n_kv, T, d) quantized pre-RoPE keys
        k_hat = _o.rope_apply(Cq, np.arange(c.shape[-1]), _np(inv_freqs), traditional=traditional)
        out = _o.retrieval_attention(_np(q_post), k_hat, _np(v), np.asarray(mask), scale=scale).astype(np.float32)
        return (out, mask) if return_mask else out


class FarQueryInAttention(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        out, mask = self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                          topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=scale,
                                          return_mask=True)
        q_far = _o.far_query(_np(q_post), b=b, inv_freqs=_np(inv_freqs), traditional=traditional,
                             positions=query_pos)
        out = _o.retrieval_attention(q_far, _np(k_post), _np(v), np.asarray(mask), scale=scale).astype(np.float32)
        return (out, mask) if return_mask else out


class Float16Lut(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        qb = _np(self._ref.far_query(q_post, b=b, inv_freqs=inv_freqs, traditional=traditional,
                                     positions=np.int64(query_pos)))
        C16 = np.asarray(C).astype(np.float16)
        n_q, d = qb.shape[-2:]
        G = n_q // C16.shape[0]
        s = np.float16(1.0 / math.sqrt(d) if scale is None else scale)
        lut = np.stack([(qb[h].astype(np.float16) @ C16[h // G].T) * s for h in range(n_q)])
        scores = _o.token_scores(lut.astype(np.float64), np.asarray(codes)).astype(np.float32)
        mask = self._ref.select_tokens(scores, n_kv_heads=C16.shape[0], query_pos=query_pos, w=w, sinks=sinks, topk=topk)
        out = self._ref.retrieval_attention(q_post, k_post, v, mask, scale=scale)
        return (out, mask) if return_mask else out


class TopkFloat32(Mutant):
    def topk_count(self, T, topk, n_candidates=None):
        if isinstance(topk, float):
            n = int(np.float32(topk) * np.float32(T))
            return n if n_candidates is None else min(n, n_candidates)
        return self._ref.topk_count(T, topk) if n_candidates is None else self._ref.topk_count(T, topk, n_candidates)


class SelectClampsQueryPos(Mutant):
    def select_tokens(self, scores, *, query_pos, **kw):
        T = np.asarray(scores).shape[-1]
        return self._ref.select_tokens(scores, query_pos=min(max(int(query_pos), 0), T - 1), **kw)


class TokenScoresClipsCodes(Mutant):
    def token_scores(self, lut, codes):
        K = np.asarray(lut).shape[-1]
        c = np.asarray(codes)
        return self._ref.token_scores(lut, np.clip(c.astype(np.int64), 0, K - 1).astype(c.dtype))


class DecodeClampsQueryPos(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, **kw):
        T = np.asarray(k_post).shape[-2]
        return self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=min(max(int(query_pos), 0), T - 1), **kw)


class DecodeWrapsCodes(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, **kw):
        K = np.asarray(C).shape[-2]
        c = np.asarray(codes)
        return self._ref.decode_step(q_post, k_post, v, (c.astype(np.int64) % K).astype(np.uint16), C, **kw)


class DecodeIgnoresScale(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        return self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                     topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=None,
                                     return_mask=return_mask)


class LutPostRopeQuery(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        qb = _o.far_query(_np(q_post), b=b, inv_freqs=_np(inv_freqs), traditional=traditional)   # positions left out
        s = _o.token_scores(_o.lut_scores(qb, _np(C)), np.asarray(codes))
        mask = np.asarray(self._ref.select_tokens(s.astype(np.float32), n_kv_heads=np.asarray(C).shape[0],
                                                  query_pos=query_pos, w=w, sinks=sinks, topk=topk))
        out = self._ref.retrieval_attention(q_post, k_post, v, mask, scale=scale)
        return (out, mask) if return_mask else out


class TopkOverCandidates(Mutant):
    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        j = np.arange(np.asarray(scores).shape[-1])
        i = int(query_pos)
        n_cand = int(np.sum((j <= i) & (j >= sinks) & (i - j >= w)))
        if isinstance(topk, float):
            k = int(topk * n_cand)
            topk = k if k >= 1 else 1e-12     # a count of 0 (the never-empty rule still applies)
        return self._ref.select_tokens(scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks, topk=topk)


class SelectBatchedStridedGroups(Mutant):
    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        if s.ndim > 2:
            G = s.shape[-2] // n_kv_heads
            # KV head g gets query heads g, g + n_kv, ... (as heads laid out kv-major) instead of g*G ... g*G+G-1
            s = s[..., [g + n_kv_heads * j for g in range(n_kv_heads) for j in range(G)], :]
        return self._ref.select_tokens(s, n_kv_heads=n_kv_heads, **kw)


class TopkOneIsAFraction(Mutant):
    def topk_count(self, T, topk, n_candidates=None):
        if not isinstance(topk, bool) and topk <= 1:
            topk = float(topk)
        return self._ref.topk_count(T, topk) if n_candidates is None else self._ref.topk_count(T, topk, n_candidates)


class OwnTokenAtCountZero(Mutant):
    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        mask = np.array(self._ref.select_tokens(scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks,
                                                topk=topk))
        i = int(query_pos)
        n_cand = sum(1 for j in range(i + 1) if j >= sinks and i - j >= w)
        if _o.topk_count(i + 1, topk, n_cand) == 0:
            mask[..., i] = True
        return mask


class DecodeQueryAtLastToken(Mutant):
    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, **kw):
        return self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=np.asarray(k_post).shape[-2] - 1, **kw)


class AttentionEmptyRowAverages(Mutant):
    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        m = np.asarray(mask)
        if m.dtype != np.bool_ or m.any(axis=-1).all():
            return self._ref.retrieval_attention(q, k, v, mask, scale=scale)
        q, k, v = _np(q), _np(k), _np(v)
        G = q.shape[-2] // k.shape[-3]
        kk, vv, mm = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3), np.repeat(m, G, axis=-2)
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        logits = np.where(mm, s * np.einsum("...hd,...htd->...ht", q, kk), -1e9)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return np.einsum("...ht,...htd->...hd", p / p.sum(axis=-1, keepdims=True), vv).astype(np.float32)


class AttentionBatchRowZeroMask(Mutant):
    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        m = np.asarray(mask)
        if m.ndim > 2:
            m = np.broadcast_to(m.reshape((-1,) + m.shape[-2:])[0], m.shape).copy()
        return self._ref.retrieval_attention(q, k, v, m, scale=scale)


class GroupUnionFirst8Heads(Mutant):
    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        G = s.shape[-2] // n_kv_heads
        if G <= 8:
            return self._ref.select_tokens(s, n_kv_heads=n_kv_heads, **kw)
        lanes = np.arange(s.shape[-2]) % G < 8
        return self._ref.select_tokens(s[..., lanes, :], n_kv_heads=n_kv_heads, **kw)


class Float16ScaleDropped(Mutant):
    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        if np.asarray(q).dtype == np.float16:
            scale = None
        return self._ref.retrieval_attention(q, k, v, mask, scale=scale)
