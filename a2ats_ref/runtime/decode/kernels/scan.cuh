// RET-DECODE on CUDA: the token scan the attend and mask kernels share (each appends its own body to this one).
// Shared helpers are in common.cuh.
    constexpr int NT = NW * 32, EMAX = A2ATS_CHUNK_MAX / NT;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const a2ats_step P(ipa_shape, ipb_shape);
    const int n = P.n, c0 = P.c0, c1 = P.c1, S = P.S;
    const int Tc = codes_shape[2];
    const int n1 = nsel[r * 3], n2 = nsel[r * 3 + 1];
    const CodeT* crow = codes + (size_t)r * Tc;
    // SMEM bytes: the code levels and the token list here; the attend kernel reuses them for its warps' partials
    __shared__ __align__(16) unsigned char a2ats_smem[SMEM];
    unsigned char* lvs = a2ats_smem;
    int* tok = reinterpret_cast<int*>(a2ats_smem + (KS + 15) / 16 * 16);
    __shared__ int ws[NW], before[2];
    if (KS % 16 == 0)   // rows of levels start 16-byte aligned then (MLX allocates at least that)
        for (int k = tid; k < KS / 16; k += NT)
            reinterpret_cast<uint4*>(lvs)[k] = reinterpret_cast<const uint4*>(levels + (size_t)r * KS)[k];
    else
        for (int k = tid; k < KS; k += NT) lvs[k] = levels[(size_t)r * KS + k];
    if (tid < 2) before[tid] = 0;
    const int j0 = c * P.chunk, j1 = min(j0 + P.chunk, n);
    // each thread E consecutive tokens, their codes loaded at once (one round of memory latency per block)
    const int E = P.chunk / NT, jt = j0 + tid * E;
    int cd[EMAX];
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
        const int j = jt + e;
        cd[e] = (e < E && j < j1 && j >= c0 && j < c1) ? (int)crow[j] : -1;
    }
    const bool cut = n1 + n2 > S;
    __syncthreads();
    int lv[EMAX], k1 = 0, k2 = 0;
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
        const int j = jt + e;
        lv[e] = cd[e] >= 0 ? (int)lvs[cd[e]] : ((e < E && j < j1) ? 3 : 0);
        k1 += lv[e] == 1;
        k2 += lv[e] == 2;
    }
    int r1 = 0, r2 = 0;   // the level-1 and level-2 candidates before this thread's first token
    if (cut) {   // the S-slot cut binds: rank among all candidates, those before the chunk too (O(T) per block)
        int a1 = 0, a2 = 0;
        for (int j = c0 + tid; j < min(j0, c1); j += NT) {
            const int l = lvs[(int)crow[j]];
            a1 += l == 1;
            a2 += l == 2;
        }
        for (int off = 16; off > 0; off >>= 1) {
            a1 += __shfl_down_sync(0xffffffffu, a1, off);
            a2 += __shfl_down_sync(0xffffffffu, a2, off);
        }
        if (lane == 0 && (a1 || a2)) { atomicAdd(&before[0], a1); atomicAdd(&before[1], a2); }
        int total;
        const int ex = a2ats_block_scan<NW>((k1 << 16) | k2, ws, total);   // counts <= A2ATS_CHUNK_MAX < 2^16
        r1 = before[0] + (ex >> 16);
        r2 = before[1] + (ex & 0xffff);
    }
    int kt = 0;
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
        const bool take = lv[e] == 3 || (lv[e] == 1 && r1 < S) || (lv[e] == 2 && n1 + r2 < S);
        r1 += lv[e] == 1;
        r2 += lv[e] == 2;
        lv[e] = take;
        kt += take;
    }
    int m;
    int pt = a2ats_block_scan<NW>(kt, ws, m);
#pragma unroll
    for (int e = 0; e < EMAX; ++e)
        if (lv[e]) tok[pt++] = jt + e;
    __syncthreads();   // tok[0, m): the chunk's taken tokens, in index order
