// RET-DECODE on CUDA: the mask kernel's body (mx.fast.cuda_kernel source). MLX builds its signature from the
// input and output names in runtime/decode/cuda.py's KERNELS; the shared helpers are in common.cuh.
    for (int i = tid; i < m; i += NT) sel[(size_t)r * n + tok[i]] = 1;
