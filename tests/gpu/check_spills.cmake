# Asserts, from ptxas's report (REPORT), that the fused update kernel was
# compiled and that no kernel spills registers. Prints the report's register
# lines so the test log shows them.
file(READ ${REPORT} report)
string(REGEX MATCHALL "Compiling entry function '[^']*UpdateKernel[^']*' for 'sm_[0-9]+'" updates "${report}")
list(LENGTH updates update_count)
if(update_count EQUAL 0)
  message(FATAL_ERROR "no UpdateKernel in ${REPORT}:\n${report}")
endif()
string(REGEX MATCHALL "[0-9]+ bytes spill (stores|loads)" spills "${report}")
foreach(spill IN LISTS spills)
  if(NOT spill MATCHES "^0 ")
    message(FATAL_ERROR "a kernel spills (${spill}):\n${report}")
  endif()
endforeach()
string(REGEX MATCHALL "Compiling entry function '[^']*' for 'sm_[0-9]+'|Used [0-9]+ registers" lines "${report}")
string(REPLACE ";" "\n" lines "${lines}")
message(STATUS "${update_count} UpdateKernel variants, no spills:\n${lines}")
