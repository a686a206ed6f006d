// RET-DECODE on CUDA: the step kernel's head (mx.fast.cuda_kernel source), followed by scan.cuh and attend.cu. MLX
// builds its signature from the input and output names in runtime/decode/cuda.py's KERNELS; the shared helpers are
// in common.cuh.
//
// A block's job is its ticket (sync[0], taken when the block starts), not its blockIdx. The first BH * NL tickets
// each compute the LUT of one part of one row's codes; the last part of a row to finish runs the row's radix select
// and raises the row's ready flag. Every later ticket attends to one chunk of one row, once that row is ready. A
// block waits only for tickets taken before its own, by blocks that are running, and those never wait: the step
// cannot deadlock, whatever order and number of blocks the GPU runs at once.
//
// sync (S ints, zero at launch): [0] the ticket, [1, 1 + BH) the LUT parts done per row, [1 + BH, 1 + 2 BH) the
// ready flags. The block of ticket 0 zeroes sync_out, which the next step takes as its sync (cuda.decode).
    constexpr int NT = NW * 32, H2 = D / 2, NL = (KS + 4 * NT - 1) / (4 * NT);
    const int tid = threadIdx.x, lane = tid & 31;
    const a2ats_step P(ipa_shape, ipb_shape);
    const int Tc = codes_shape[2], BH = codes_shape[0] * codes_shape[1], NC = (P.n + P.chunk - 1) / P.chunk;
    int* const tick = const_cast<int*>(sync);
    int* const parts_done = tick + 1;
    int* const ready = tick + 1 + BH;
    __shared__ __align__(16) unsigned char a2ats_smem[SMEM];
    __shared__ int job_s, last_part;
    if (tid == 0) job_s = atomicAdd(tick, 1);
    __syncthreads();
    const int job = job_s;
    if (job == 0)
        for (int i = tid; i < sync_shape[0]; i += NT) sync_out[i] = 0;
    // a ticket outside the grid only comes from counters that were not zero at launch: no job, and the step's
    // outputs are left unwritten (the self-check fails) rather than indexing outside its rows
    if ((unsigned)job >= (unsigned)(BH * (NL + NC))) return;
    if (job < BH * NL) {
        const int r = job / NL, part = job - r * NL, h = r % NKV, warp = tid >> 5;
        const int kk = P.kk, c0 = P.c0, c1 = P.c1, counted = P.counted, kept = P.kept, sinks = P.sinks, w = P.w;
        float* qs = reinterpret_cast<float*>(a2ats_smem);   // G * D
        float* rot = qs + G * D;                              // 4 * H2
        // EQ-12. The angles depend on the pair i only. The applied angle is the float32 product qpos * inv[i] (what
        // mlx-lm's rope formed) and its cos/sin are taken in double: cosf/sinf of an argument past ~1e5 rad
        // (positions past 105,615 at inv = 1) take CUDA's slow reduction path (0.23 ms at 256K)
        for (int i = tid; i < H2; i += NT) {
            if (TABLES) { rot[i] = tc[i]; rot[H2 + i] = ts[i]; }
            else { double sd, cd; sincos((double)(P.qpos * inv[i]), &sd, &cd); rot[i] = (float)cd; rot[H2 + i] = (float)sd; }
            float s2, c2;
            sincosf(P.b * inv[i], &s2, &c2);
            rot[2 * H2 + i] = c2;
            rot[3 * H2 + i] = s2;
        }
        __syncthreads();
        for (int e = tid; e < G * H2; e += NT) {
            const int g = e / H2, i = e - g * H2;
            const int ia = TRAD ? 2 * i : i, ib = TRAD ? 2 * i + 1 : i + H2;
            const size_t base = ((size_t)r * G + g) * D;
            const float x0 = a2ats_f32(q[base + ia]), x1 = a2ats_f32(q[base + ib]);
            const float c1_ = rot[i], s1 = rot[H2 + i], c2 = rot[2 * H2 + i], s2 = rot[3 * H2 + i];
            const float a1 = x0 * c1_ + x1 * s1, b1 = x1 * c1_ - x0 * s1;
            qs[g * D + ia] = (a1 * c2 - b1 * s2) * P.scale;
            qs[g * D + ib] = (a1 * s2 + b1 * c2) * P.scale;
        }
        __syncthreads();
        // this part's LUT: each thread four adjacent codes, one 16-byte load of CT per dimension
        float* lrow = lut + (size_t)r * G * KS;
        const int k0 = part * 4 * NT, k1 = min(KS, k0 + 4 * NT);
        if (KS % 4 == 0) {
            const float4* col = reinterpret_cast<const float4*>(CT + (size_t)h * D * KS);
            const int k4 = k0 / 4 + tid;
            if (k4 < k1 / 4) {
                float acc[G][4];
                for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.0f;
#pragma unroll 8
                for (int dd = 0; dd < D; ++dd) {
                    const float4 cv = col[(size_t)dd * (KS / 4) + k4];
                    for (int g = 0; g < G; ++g) {
                        const float qv = qs[g * D + dd];
                        acc[g][0] = fmaf(qv, cv.x, acc[g][0]);
                        acc[g][1] = fmaf(qv, cv.y, acc[g][1]);
                        acc[g][2] = fmaf(qv, cv.z, acc[g][2]);
                        acc[g][3] = fmaf(qv, cv.w, acc[g][3]);
                    }
                }
                for (int g = 0; g < G; ++g)
                    *reinterpret_cast<float4*>(lrow + (size_t)g * KS + 4 * k4) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            }
        } else {
            for (int k = k0 + tid; k < k1; k += NT) {
                float acc[G];
                for (int g = 0; g < G; ++g) acc[g] = 0.0f;
                const float* col = CT + (size_t)h * D * KS + k;
                for (int dd = 0; dd < D; ++dd) {
                    const float cv = col[(size_t)dd * KS];
                    for (int g = 0; g < G; ++g) acc[g] = fmaf(qs[g * D + dd], cv, acc[g]);
                }
                for (int g = 0; g < G; ++g) lrow[(size_t)g * KS + k] = acc[g];
            }
        }
        // The row's last part to finish runs its select: the fence makes this block's LUT visible before its
        // count, and the select reads the other parts' LUT from L2 (__ldcg)
        __threadfence();
        __syncthreads();
        if (tid == 0) last_part = atomicAdd(parts_done + r, 1) == NL - 1;
        __syncthreads();
        if (!last_part) return;
        __threadfence();
        int* cnt = reinterpret_cast<int*>(rot + 4 * H2);     // KS
        int* hist = cnt + KS;                                // G * 256
        unsigned* pre = reinterpret_cast<unsigned*>(hist + G * 256);
        int* rem = reinterpret_cast<int*>(pre + G);
        int* above = rem + G;
        int* nge = above + G;
        int* n12 = nge + G;                                  // 2
        // the candidates' code counts: the kept counts less the sinks and the coded window tail, or counted here
        if (kept) {
            for (int cc = tid; cc < KS; cc += NT) cnt[cc] = counts[(size_t)r * KS + cc];
            __syncthreads();
            for (int p = tid; p < sinks; p += NT)
                if (p < c0) atomicSub(&cnt[(int)codes[(size_t)r * Tc + p]], 1);
            for (int j = tid; j < w; j += NT)
                if (c1 + j < counted) atomicSub(&cnt[(int)codes[(size_t)r * Tc + c1 + j]], 1);
        } else {
            for (int cc = tid; cc < KS; cc += NT) cnt[cc] = 0;
            __syncthreads();
            for (int j = c0 + tid; j < c1; j += NT) atomicAdd(&cnt[(int)codes[(size_t)r * Tc + j]], 1);
        }
        if (tid < G) { pre[tid] = 0u; rem[tid] = kk; above[tid] = 0; }
        if (tid < 2) n12[tid] = 0;
        // each query head's kk-th largest candidate score: a radix select over the code scores weighted by the
        // counts, 8 bits per pass (the first pass's barrier also orders the counts and the fields above)
        for (int pass = 0; pass < 4; ++pass) {
            const int shift = 24 - 8 * pass;
            const unsigned himask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
            for (int e = tid; e < G * 256; e += NT) hist[e] = 0;
            __syncthreads();
            for (int cc = tid; cc < KS; cc += NT) {
                const int nc = cnt[cc];
                if (nc > 0) {
                    for (int g = 0; g < G; ++g) {
                        const unsigned key = a2ats_key(__ldcg(lrow + (size_t)g * KS + cc));
                        if (((key ^ pre[g]) & himask) == 0u) atomicAdd(&hist[g * 256 + ((key >> shift) & 255u)], nc);
                    }
                }
            }
            __syncthreads();
            for (int g = warp; g < G; g += NW) {
                int loc = 0;
                for (int i = 0; i < 8; ++i) loc += hist[g * 256 + 255 - 8 * lane - i];
                int incl = loc;
                for (int off = 1; off < 32; off <<= 1) {
                    const int y = __shfl_up_sync(0xffffffffu, incl, off);
                    if (lane >= off) incl += y;
                }
                const int need = rem[g];
                const unsigned hit = __ballot_sync(0xffffffffu, incl >= need && incl - loc < need);
                const int L = hit ? __ffs(hit) - 1 : 31;
                if (lane == L) {
                    int acc = incl - loc, digit = 255 - 8 * lane - 7;
                    for (int i = 0; i < 8; ++i) {
                        const int bin = 255 - 8 * lane - i;
                        const int hb = hist[g * 256 + bin];
                        if (acc + hb >= need) { digit = bin; break; }
                        acc += hb;
                    }
                    pre[g] |= ((unsigned)digit) << shift;
                    rem[g] = need - acc;
                    above[g] += acc;
                    if (pass == 3) nge[g] = above[g] + hist[g * 256 + digit];
                }
            }
            __syncthreads();
        }
        // each code's level (1 must, 2 tie at a threshold, 0 not) and the level token counts n1, n2
        int a1 = 0, a2 = 0;
        for (int cc = tid; cc < KS; cc += NT) {
            bool must = false, ge = false;
            for (int g = 0; g < G; ++g) {
                const unsigned key = a2ats_key(__ldcg(lrow + (size_t)g * KS + cc));
                const bool gt = key > pre[g], eq = key == pre[g];
                must = must || gt || (eq && nge[g] == kk);
                ge = ge || gt || eq;
            }
            const int lv = must ? 1 : (ge ? 2 : 0);
            levels[(size_t)r * KS + cc] = (unsigned char)lv;
            if (lv == 1) a1 += cnt[cc];
            if (lv == 2) a2 += cnt[cc];
        }
        for (int off = 16; off > 0; off >>= 1) {
            a1 += __shfl_down_sync(0xffffffffu, a1, off);
            a2 += __shfl_down_sync(0xffffffffu, a2, off);
        }
        if (lane == 0) { atomicAdd(&n12[0], a1); atomicAdd(&n12[1], a2); }
        __syncthreads();
        // the third column is the row's merge ticket (attend.cu)
        if (tid == 0) { nsel[r * 3] = n12[0]; nsel[r * 3 + 1] = n12[1]; nsel[r * 3 + 2] = 0; }
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(ready + r, 1);
        return;
    }
    const int r = (job - BH * NL) / NC, c = (job - BH * NL) - r * NC;
    const int* const await_flag = ready + r;
