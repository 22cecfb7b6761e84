/* quant_gemm.c's panels of Q4_0 blocks, compiled on their own (see there). */
#define QUANT_PANELS_OF GGML_TYPE_Q4_0
#define QUANT_PANELS_NAME quant_panels_q4_0
#include "quant_gemm.c"
