"""Data type names the configs accept and their size, shared by the config and the cost model."""

DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per element
AUTO_DTYPE = "auto"  # model.dtype: the checkpoint's dtype on a GPU, float32 on a CPU
