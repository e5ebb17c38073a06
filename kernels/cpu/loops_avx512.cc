#define SHARDOPT_LOOPS_NAMESPACE avx512
#include "kernels/cpu/loops_impl.h"
