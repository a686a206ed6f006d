// RET-DECODE on CUDA: the mask kernel's head, followed by scan.cuh and mask.cu: a block's row and chunk are its grid
// position, and the levels it scans were made by an earlier launch (nothing to wait for).
    constexpr int NT = NW * 32;
    const int tid = threadIdx.x, lane = tid & 31;
    const a2ats_step P(ipa_shape, ipb_shape);
    const int Tc = codes_shape[2], r = blockIdx.y, c = blockIdx.x, NC = gridDim.x;
    __shared__ __align__(16) unsigned char a2ats_smem[SMEM];
    const int* const await_flag = nullptr;
