"""The trainer's machinery, beside the recipe in train_gpt.py:

    config.py         the config's schema: types from annotations, ranges beside fields, checks
    errors.py         UserError: what a user can cause, ending in one line
    processes.py      launch, the process group, signals, collectives' guards
    memory_budget.py  what a run needs on each device, and the plan run.sh starts
    sparse_tables.py  the n-gram table split across processes or in host memory, its row gradients
    cuda_graphs.py    the step's captured CUDA graphs and their static buffers
    checkpoint.py     the checkpoint format (safetensors with a hash), its writer and reader
    cpu_runtime.py    the CPU's bf16 GEMM path and allocator settings
    resume.py         the resume state a run writes every --resume_every steps
    progress.py       the progress lines and their ETA
    metrics.py        the --metrics file
    no_triton.py      what stands in for triton where it cannot be imported
"""
