"""Offline weight quantization algorithms (`pagellm quantize`): plain tensor math on one matrix at a time.

`rtn` rounds each group to nearest (and holds `GroupQuant`, the integer codes every method produces),
`gptq` quantizes column by column with Hessian-based error feedback (Frantar et al., 2022), `awq` searches
per-input-channel scales from activation magnitudes (Lin et al., 2023). They import nothing of the model:
`pagellm.quant.quantize_cli` runs the model and hands them matrices and activations.
"""
