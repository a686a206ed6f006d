// RET-DECODE on CUDA: the attend kernel's body (mx.fast.cuda_kernel source). MLX builds its signature from the
// input and output names in runtime/decode/cuda.py's KERNELS; the shared helpers are in common.cuh.
    constexpr int LPR = D / EPL, RW = 32 / LPR;
    const int warp = tid >> 5, sub = lane / LPR, li = lane % LPR;
    const int Tb = keys_shape[2];
    const float NEG = __int_as_float(0xff800000);
    __shared__ float sq[G * D];
    for (int e = tid; e < G * D; e += NT) sq[e] = a2ats_f32(q[(size_t)r * G * D + e]) * P.scale;
    __syncthreads();
    float acc[G][EPL], mm[G], ll[G];
    for (int g = 0; g < G; ++g) {
        mm[g] = NEG;
        ll[g] = 0.0f;
        for (int e = 0; e < EPL; ++e) acc[g][e] = 0.0f;
    }
    for (int i0 = warp * RW * U; i0 < m; i0 += NW * RW * U) {
        a2ats_vec<T, EPL> kx[U], vx[U];
        bool ok[U];
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * RW + sub;
            ok[u] = i < m;
            const size_t row = ((size_t)r * Tb + (size_t)tok[ok[u] ? i : i0]) * D + li * EPL;
            kx[u] = *reinterpret_cast<const a2ats_vec<T, EPL>*>(keys + row);
            vx[u] = *reinterpret_cast<const a2ats_vec<T, EPL>*>(values + row);
        }
        float p[U][G];
        for (int u = 0; u < U; ++u) {
            for (int g = 0; g < G; ++g) {
                float s = 0.0f;
                for (int e = 0; e < EPL; ++e) s = fmaf(sq[g * D + li * EPL + e], a2ats_f32(kx[u].v[e]), s);
                for (int off = LPR / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                p[u][g] = ok[u] ? s : NEG;
            }
        }
        float corr[G];
        for (int g = 0; g < G; ++g) {
            float top = mm[g];
            for (int u = 0; u < U; ++u) top = fmaxf(top, p[u][g]);
            corr[g] = top > NEG ? expf(mm[g] - top) : 1.0f;
            float ps = 0.0f;
            for (int u = 0; u < U; ++u) {
                p[u][g] = top > NEG ? expf(p[u][g] - top) : 0.0f;
                ps += p[u][g];
            }
            ll[g] = ll[g] * corr[g] + ps;
            mm[g] = top;
        }
        for (int g = 0; g < G; ++g)
            for (int e = 0; e < EPL; ++e) acc[g][e] *= corr[g];
        for (int u = 0; u < U; ++u) {
            for (int e = 0; e < EPL; ++e) {
                const float v = a2ats_f32(vx[u].v[e]);
                for (int g = 0; g < G; ++g) acc[g][e] = fmaf(p[u][g], v, acc[g][e]);
            }
        }
    }
    // the warp's RW lane groups, merged pairwise (xor over the group index)
    for (int off = LPR; off < 32; off <<= 1) {
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, mm[g], off), lo = __shfl_xor_sync(0xffffffffu, ll[g], off);
            const float M = fmaxf(mm[g], mo);
            const float fa = M > NEG ? expf(mm[g] - M) : 0.0f, fb = M > NEG ? expf(mo - M) : 0.0f;
            ll[g] = ll[g] * fa + lo * fb;
            for (int e = 0; e < EPL; ++e) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
                acc[g][e] = acc[g][e] * fa + ao * fb;
            }
            mm[g] = M;
        }
    }
    __syncthreads();   // every warp is done with tok: its bytes take the warps' partials
    float* sm = reinterpret_cast<float*>(a2ats_smem);
    float* sl = sm + NW * G;
    float* sacc = sl + NW * G;
    if (sub == 0) {
        for (int g = 0; g < G; ++g) {
            if (li == 0) { sm[warp * G + g] = mm[g]; sl[warp * G + g] = ll[g]; }
            for (int e = 0; e < EPL; ++e) sacc[(warp * G + g) * D + li * EPL + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int e = tid; e < G * D; e += NT) {
        const int g = e / D, dd = e - g * D;
        float M = NEG;
        for (int q2 = 0; q2 < NW; ++q2) M = fmaxf(M, sm[q2 * G + g]);
        float Ls = 0.0f, A = 0.0f;
        if (M > NEG) {
            for (int q2 = 0; q2 < NW; ++q2) {
                const float f = expf(sm[q2 * G + g] - M);
                Ls += f * sl[q2 * G + g];
                A += f * sacc[(q2 * G + g) * D + dd];
            }
        }
        const size_t o = ((size_t)r * gridDim.x + c) * G + g;
        pacc[o * D + dd] = A;
        if (dd == 0) { pm[o] = M; pl[o] = Ls; }
    }
    // The row's last block to finish merges every block's partials into out: a ticket per row, zeroed by the
    // select kernel in nsel's third column, counts the finished blocks; the fence makes each block's partials
    // visible before its ticket, and the merge reads them from L2.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (tid == 0) last = atomicAdd(const_cast<int*>(nsel) + r * 3 + 2, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // every other block has taken its ticket: reset it, so a second attend over the same nsel merges too
    if (tid == 0) const_cast<int*>(nsel)[r * 3 + 2] = 0;
    // One block merges NC partials (over a hundred at long contexts), spread over the whole block: warps find each
    // head's max and sum over the blocks, then every thread sums a float4 of outputs over every SPLIT-th partial
    // (16-byte loads, several in flight), and the SPLIT sums of each float4 meet in shared memory.
    const int NC = gridDim.x;
    const size_t base = (size_t)r * NC;
    __shared__ float Mg[G], Lg[G];
    for (int g = warp; g < G; g += NW) {
        float M = NEG, L = 0.0f;
        for (int c2 = lane; c2 < NC; c2 += 32) M = fmaxf(M, __ldcg(pm + (base + c2) * G + g));
        for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        for (int c2 = lane; c2 < NC; c2 += 32) {
            const float mc = __ldcg(pm + (base + c2) * G + g);
            if (mc > NEG) L += expf(mc - M) * __ldcg(pl + (base + c2) * G + g);
        }
        for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
        if (lane == 0) { Mg[g] = M; Lg[g] = L; }
    }
    __syncthreads();
    constexpr int T4 = G * D / 4, SPLIT = NT / T4;   // float4 outputs, threads per output (shapes_supported: >= 1)
    const int o4 = tid % T4, part = tid / T4, g4 = o4 * 4 / D;
    float4 A = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (part < SPLIT) {
        const float4* src = reinterpret_cast<const float4*>(pacc + base * G * D) + o4;
#pragma unroll 8
        for (int c2 = part; c2 < NC; c2 += SPLIT) {
            const float mc = __ldcg(pm + (base + c2) * G + g4);
            const float wgt = mc > NEG ? expf(mc - Mg[g4]) : 0.0f;
            const float4 v = __ldcg(src + (size_t)c2 * T4);
            A.x = fmaf(wgt, v.x, A.x);
            A.y = fmaf(wgt, v.y, A.y);
            A.z = fmaf(wgt, v.z, A.z);
            A.w = fmaf(wgt, v.w, A.w);
        }
    }
    float4* red = reinterpret_cast<float4*>(a2ats_smem);   // the partials' shared bytes are free again
    red[tid] = A;
    __syncthreads();
    if (part == 0) {
        for (int p2 = 1; p2 < SPLIT; ++p2) {
            const float4 y = red[p2 * T4 + o4];
            A.x += y.x; A.y += y.y; A.z += y.z; A.w += y.w;
        }
        const float inv_l = 1.0f / Lg[g4];
        T* dst = out + (size_t)r * G * D + o4 * 4;
        dst[0] = static_cast<T>(A.x * inv_l);
        dst[1] = static_cast<T>(A.y * inv_l);
        dst[2] = static_cast<T>(A.z * inv_l);
        dst[3] = static_cast<T>(A.w * inv_l);
    }
