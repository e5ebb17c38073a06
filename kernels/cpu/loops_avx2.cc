#define SHARDOPT_LOOPS_NAMESPACE avx2
#include "kernels/cpu/loops_impl.h"
