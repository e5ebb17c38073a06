# Builds tests/fuzz/grad_message_fuzz.cc with clang's libFuzzer, ASAN and
# UBSAN, and runs it for SECONDS: any disagreement with protobuf, or any
# sanitizer report, fails the test with the input that caused it. The corpus
# stays in WORK between runs.
#   cmake -DCLANGXX=... -DSOURCE_DIR=... -DBINARY_DIR=... -DPROTO_LIB=... -DWORK=... -DSECONDS=... -P run_fuzz.cmake
execute_process(COMMAND pkg-config --libs grpc++ protobuf OUTPUT_VARIABLE libs OUTPUT_STRIP_TRAILING_WHITESPACE)
separate_arguments(libs UNIX_COMMAND "${libs}")
file(MAKE_DIRECTORY ${WORK}/corpus)
# The reader's sources are compiled again here, by clang, rather than linked
# from the GCC build: libFuzzer steers by the coverage that clang instruments.
execute_process(
  COMMAND ${CLANGXX} -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -I${SOURCE_DIR} -I${BINARY_DIR}/proto
          ${SOURCE_DIR}/tests/fuzz/grad_message_fuzz.cc ${SOURCE_DIR}/server/grad_message.cc
          ${SOURCE_DIR}/rpc/wire_format.cc ${SOURCE_DIR}/base/pieces.cc ${PROTO_LIB} ${libs}
          -labsl_status -labsl_strings -labsl_cord -labsl_str_format_internal -o ${WORK}/grad_message_fuzz
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the fuzzer failed:\n${out}${err}")
endif()
# Protobuf logs every string field that is not UTF-8, most of the inputs:
# the run's output goes to a file, and only its end is shown on a failure.
# A fixed seed: a fresh build (CI's) tries the same inputs in the same order
# every time, as far as it gets in SECONDS, so a failure there repeats; a
# kept corpus takes later runs further. Seeds 1, 2 and 3 each found the
# reader's old no_grad miscount within 20 s.
execute_process(
  COMMAND ${WORK}/grad_message_fuzz -seed=1 -max_total_time=${SECONDS} -max_len=512 -artifact_prefix=${WORK}/
          ${WORK}/corpus
  RESULT_VARIABLE rc OUTPUT_FILE ${WORK}/run.log ERROR_FILE ${WORK}/run.log)
if(NOT rc EQUAL 0)
  execute_process(COMMAND tail -n 40 ${WORK}/run.log OUTPUT_VARIABLE tail)
  message(FATAL_ERROR "the fuzzer failed (${rc}); its input is in ${WORK}/crash-*:\n${tail}")
endif()
execute_process(COMMAND tail -n 12 ${WORK}/run.log OUTPUT_VARIABLE tail)
message(STATUS "${tail}")
