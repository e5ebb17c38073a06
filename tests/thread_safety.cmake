# Runs clang's thread-safety analysis over the given sources (the protocol
# core's locks are annotated: ABSL_GUARDED_BY and friends): any warning or
# error fails the test. GCC, which builds everything else, ignores the
# annotations, and takes some code that clang refuses.
#   cmake -DCLANGXX=... -DSOURCE_DIR=... -DBINARY_DIR=... -DSOURCES="server/a.cc;client/b.cc" -P thread_safety.cmake
foreach(source IN LISTS SOURCES)
  execute_process(
    COMMAND ${CLANGXX} -std=c++17 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror
            -I${SOURCE_DIR} -I${SOURCE_DIR}/client/include -I${BINARY_DIR}/proto ${SOURCE_DIR}/${source}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "thread-safety analysis of ${source} failed:\n${out}${err}")
  endif()
  message(STATUS "${source}: no thread-safety warnings")
endforeach()
