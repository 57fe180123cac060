# CLI test of flatep-plan, run as:
#   cmake -DPLAN=<flatep-plan binary> -DDATA=<tests/cli dir> -DWORK=<scratch dir> -P run_plan_cli.cmake
# Valid inputs must give a plan whose JSON has every key; invalid ones must exit non-zero with exactly one line on
# stderr, equal to the expected message (never a signal). Inputs too large to check in are written to WORK.
cmake_minimum_required(VERSION 3.19)  # string(JSON)
if(NOT PLAN OR NOT DATA OR NOT WORK)
  message(FATAL_ERROR "usage: cmake -DPLAN=<flatep-plan> -DDATA=<tests/cli> -DWORK=<dir> -P run_plan_cli.cmake")
endif()
file(MAKE_DIRECTORY ${WORK})
set(failures 0)

function(expect_plan name)  # ARGN: extra options
  execute_process(COMMAND ${PLAN} ${ARGN} ${DATA}/${name} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(SEND_ERROR "${name} ${ARGN}: exit ${rc}, stderr: ${err}")
    return()
  endif()
  if(NOT err STREQUAL "")
    message(SEND_ERROR "${name} ${ARGN}: unexpected stderr: ${err}")
  endif()
  foreach(key R E S K align capacity_factor planner alloc keep slot_expert cu_seqlens stats)
    string(JSON value ERROR_VARIABLE jerr GET "${out}" ${key})
    if(jerr)
      message(SEND_ERROR "${name} ${ARGN}: output lacks \"${key}\": ${jerr}")
    endif()
  endforeach()
  foreach(key makespan total_replicas entries_moved entries_on_source max_load_before max_load_after)
    string(JSON value ERROR_VARIABLE jerr GET "${out}" stats ${key})
    if(jerr)
      message(SEND_ERROR "${name} ${ARGN}: stats lack \"${key}\"")
    endif()
  endforeach()
  set(plan_out "${out}" PARENT_SCOPE)
endfunction()

# Runs the command in ARGN (execute_process keywords such as INPUT_FILE may follow it) and checks the exit status (1,
# never a signal) and the one line on stderr.
function(expect_error_of label message)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "1")
    message(SEND_ERROR "${label}: exit status '${rc}', expected 1")
  endif()
  set(want "flatep-plan: error: ${message}\n")
  if(NOT err STREQUAL want)
    message(SEND_ERROR "${label}: stderr is\n  [${err}]\nexpected\n  [${want}]")
  endif()
endfunction()

function(expect_error name message)  # ARGN: extra options
  expect_error_of(${name} "${message}" ${PLAN} ${ARGN} ${DATA}/${name})
endfunction()

# flatep-plan under a 1 GiB address-space limit: a large input must be refused with bounded memory (before: a 50 MB
# input took 3.5 GB). Not under AddressSanitizer, whose shadow memory alone reserves terabytes of address space.
if(SANITIZE)
  set(LIMITED ${PLAN})
else()
  set(LIMITED sh -c "ulimit -v 1048576 && exec \"$@\"" sh ${PLAN})
endif()

# Valid: the hand-checked plan of tests/unit/planner/test_planner_golden.cpp (ExactTwoRanksOneReplica).
foreach(planner greedy balanced)
  expect_plan(valid_small.json --planner ${planner})
  string(JSON alloc1 GET "${plan_out}" alloc 1)
  string(REGEX REPLACE "[ \n]" "" alloc1 "${alloc1}")
  if(NOT alloc1 STREQUAL "[5,0,1,2]")
    message(SEND_ERROR "valid_small.json --planner ${planner}: alloc[1] = ${alloc1}, expected [5,0,1,2]")
  endif()
  string(JSON p GET "${plan_out}" stats makespan)
  string(JSON name GET "${plan_out}" planner)
  if(NOT p EQUAL 1 OR NOT name STREQUAL planner)
    message(SEND_ERROR "valid_small.json: makespan ${p}, planner ${name}")
  endif()
endforeach()
expect_plan(valid_small.json --compact)
string(FIND "${plan_out}" "\n" newline)
string(LENGTH "${plan_out}" len)
math(EXPR last "${len} - 1")
if(NOT newline EQUAL last)
  message(SEND_ERROR "--compact output is not one line")
endif()
expect_plan(valid_partial_slack.json --allow-partial)
string(JSON cap GET "${plan_out}" capacity)
if(NOT cap EQUAL 12)
  message(SEND_ERROR "valid_partial_slack.json: capacity ${cap}, expected 12")
endif()

# Serving layout (tests/unit/planner/test_planner_serving.cpp, OneSlotViewStrideWithPadRows): B = 1, Q = 5, 11 groups.
foreach(planner greedy balanced)
  expect_plan(valid_serving.json --compact --planner ${planner})
  string(JSON groups GET "${plan_out}" num_groups)
  string(JSON serving GET "${plan_out}" serving)
  string(JSON cu1 GET "${plan_out}" cu_seqlens 1)
  string(JSON slots1 GET "${plan_out}" slot_expert 1)
  string(REGEX REPLACE "[ \n]" "" cu1 "${cu1}")
  string(REGEX REPLACE "[ \n]" "" slots1 "${slots1}")
  if(NOT groups EQUAL 11 OR NOT serving STREQUAL "ON" OR NOT cu1 STREQUAL "[4,4,4,4,4,4,4,4,4,4,12]"
     OR NOT slots1 STREQUAL "[1,-1,-1,-1]")
    message(SEND_ERROR "valid_serving.json --planner ${planner}: groups ${groups} serving ${serving} cu_seqlens[1] "
                       "${cu1} slot_expert[1] ${slots1}")
  endif()
endforeach()
# The owner planner: the home allocation, capacity R*S*K = 16.
expect_plan(valid_small.json --compact --planner owner)
string(JSON alloc GET "${plan_out}" alloc)
string(REGEX REPLACE "[ \n]" "" alloc "${alloc}")
string(JSON cap GET "${plan_out}" capacity)
string(JSON p GET "${plan_out}" stats makespan)
if(NOT alloc STREQUAL "[[10,3,0,0],[0,0,1,2]]" OR NOT cap EQUAL 16 OR NOT p EQUAL 0)
  message(SEND_ERROR "valid_small.json --planner owner: alloc ${alloc}, capacity ${cap}, makespan ${p}")
endif()

# Invalid inputs: exact one-line messages.
expect_error(bad_json.json "invalid JSON at byte 67: syntax error while parsing array - unexpected end of input; expected ']'")
expect_error(bad_row_sum.json "tpe row 1 sums to 7, expected S*K = 8 (use --allow-partial for partial batches)")
expect_error(bad_negative.json "tpe[1][2] = -1 is negative")
expect_error(bad_size.json "tpe[1] must have E = 4 entries, got 3")
expect_error(bad_e_mod_r.json "num_experts (E) must be a multiple of num_ranks (R): E=4 R=3")
expect_error(bad_missing_tpe.json "missing field \"tpe\"")
expect_error(bad_align.json "align must be in [1, 4096], got 5000")
expect_error(valid_partial_slack.json "tpe row 1 sums to 6, expected S*K = 8 (use --allow-partial for partial batches)")
expect_error(valid_small.json "unknown planner \"fastest\" (expected greedy, balanced or owner)" --planner fastest)
expect_error(bad_num_slots.json "num_slots (B) must be -1 (= epn) or in [0, epn=4], got 5")
expect_error(valid_small.json "unknown option --verbose" --verbose)
expect_error(does_not_exist.json "cannot open ${DATA}/does_not_exist.json: No such file or directory")
# A path longer than the 40 bytes quoted input is cut at must still be printed whole.
set(long_name "a_missing_request_file_whose_name_is_much_longer_than_forty_bytes.json")
expect_error(${long_name} "cannot open ${DATA}/${long_name}: No such file or directory")

# Inputs that are not readable request files: one line, exit 1, never an abort (before: SIGABRT from an uncaught
# std::ios_base::failure "Is a directory").
expect_error(. "${DATA}/. is a directory, not a request file")
expect_error_of(stdin_directory "stdin is a directory, not a request file" ${PLAN} INPUT_FILE ${DATA})
if(EXISTS /proc/self/mem)  # opens, but reading offset 0 fails (EIO), even for root
  expect_error_of(proc_mem "cannot read /proc/self/mem: Input/output error" ${PLAN} /proc/self/mem)
endif()
execute_process(COMMAND id -u OUTPUT_VARIABLE uid OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT uid STREQUAL "0")  # root reads a mode-000 file anyway
  file(WRITE ${WORK}/unreadable.json "{}")
  file(CHMOD ${WORK}/unreadable.json PERMISSIONS OWNER_WRITE)
  expect_error_of(unreadable "cannot open ${WORK}/unreadable.json: Permission denied" ${PLAN} ${WORK}/unreadable.json)
endif()

# Size bounds (plan_request.hpp, flatep_plan.cpp): R*E at most 2^20 counts, at most that many JSON values parsed, at
# most 32 MiB read.
expect_error(bad_too_many_counts.json "R*E = 536870912 counts (R=64, E=8388608) is above flatep-plan's limit of 1048576")
string(REPEAT "0," 15000000 zeros)  # 30 MB, 15 million values: under the byte limit, far over the value limit
file(WRITE ${WORK}/many_values.json "{\"R\":2,\"E\":4,\"S\":4,\"K\":2,\"tpe\":[${zeros}0]}")
set(values_message "the input holds more than 1048656 JSON values, more than a request of at most R*E = 1048576 counts")
string(APPEND values_message " can hold (flatep-plan's limit)")
expect_error_of(many_values "${values_message}" ${LIMITED} ${WORK}/many_values.json)
string(REPEAT " " 1048576 spaces)  # 33 MiB of whitespace: over the byte limit
string(REPEAT "${spaces}" 33 spaces)
file(WRITE ${WORK}/over_32mib.json "${spaces}{}")
set(limit "flatep-plan's input limit of 33554432 bytes (32 MiB)")
expect_error_of(over_32mib "${WORK}/over_32mib.json is 34603010 bytes, above ${limit}" ${LIMITED}
                ${WORK}/over_32mib.json)
expect_error_of(over_32mib_stdin "stdin is 34603010 bytes, above ${limit}" ${LIMITED} INPUT_FILE
                ${WORK}/over_32mib.json)
# Through a pipe the size is unknown: reading stops one byte past the limit.
execute_process(COMMAND cat ${WORK}/over_32mib.json COMMAND ${LIMITED} RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc STREQUAL "1" OR NOT err STREQUAL "flatep-plan: error: stdin holds more than ${limit}\n")
  message(SEND_ERROR "over_32mib through a pipe: exit status '${rc}', stderr [${err}]")
endif()
file(REMOVE ${WORK}/many_values.json ${WORK}/over_32mib.json)
