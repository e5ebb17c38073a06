#define SHARDOPT_LOOPS_NAMESPACE generic
#include "kernels/cpu/loops_impl.h"
