"""a2ats-ref: MLX reference implementation of A2ATS."""
