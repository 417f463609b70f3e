"""The checkpoint tools (console scripts `dsv3-convert`, `dsv3-to-orbax`, `dsv3-fp8-cast-bf16`; also
`python convert/<tool>.py` from a checkout, as in the reference):

    convert         Hugging Face -> the reference's per-rank safetensors (`model{r}-mp{MP}.safetensors`)
    to_orbax        Hugging Face -> an orbax checkpoint of the model state
    fp8_cast_bf16   block-wise fp8 Hugging Face -> bf16 Hugging Face
"""
