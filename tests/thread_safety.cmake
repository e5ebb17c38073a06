# Runs clang's thread-safety analysis over the protocol core, whose locks are
# annotated (ABSL_GUARDED_BY and friends): any warning fails the test. GCC,
# which builds everything else, ignores the annotations.
#   cmake -DCLANGXX=... -DSOURCE_DIR=... -DBINARY_DIR=... -DSOURCES="a.cc;b.cc" -P thread_safety.cmake
foreach(source IN LISTS SOURCES)
  execute_process(
    COMMAND ${CLANGXX} -std=c++17 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror
            -I${SOURCE_DIR} -I${BINARY_DIR}/proto ${SOURCE_DIR}/server/${source}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "thread-safety analysis of server/${source} failed:\n${out}${err}")
  endif()
  message(STATUS "server/${source}: no thread-safety warnings")
endforeach()
