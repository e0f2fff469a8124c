"""Weight formats and how a linear layer computes with each (`LinearMethod`).

`formats` holds the block layouts as plain data (kernels/ reads them; it imports nothing else of pagellm);
`linear_method` has one LinearMethod per format: `unquantized` (float weights) and `gguf_blocks` (q4_1/q8_0
blocks read in place by few-row kernels, dequantized slices for many rows). A new format (GPTQ, AWQ, FP8,
int8/int4 weight-only) is a new LinearMethod here and touches no model file.
"""
