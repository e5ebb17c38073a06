# Compiles the kernels with NVCC and ARGS and writes everything ptxas says to OUT.
execute_process(COMMAND ${NVCC} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(WRITE ${OUT} "${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed (${rc}):\n${out}${err}")
endif()
