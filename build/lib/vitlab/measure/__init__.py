"""Measuring service shared by the tools: cases in fresh processes, timing, peak memory, the GEMM yardstick,
MAC/FLOP counting and operator profiles. It imports models, layers and mixers, never a tool."""
