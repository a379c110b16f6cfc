# fetch-llama.cmake - the llama.cpp source hobbitpy builds on.
#
# It comes from the pinned llama-cpp-python sdist on PyPI (which vendors llama.cpp
# 0c1e570, ggml 0.25.3), is checked against its sha256, unpacked into the build tree
# and patched with patches/*.patch in order. Nothing of llama.cpp is committed.
# Set HOBBITPY_LLAMA_SDIST to a local copy of the sdist to build offline, or the CMake
# variable HOBBITPY_LLAMA_SRC to a tree already unpacked, checked and patched this way
# (scripts/pack-device-check.sh makes one for a machine that reaches no network).

set(HOBBITPY_LLAMA_SDIST_URL
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz")
set(HOBBITPY_LLAMA_SDIST_SHA256 "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")

function(hobbitpy_fetch_llama out_src_dir)
    if(HOBBITPY_LLAMA_SRC)
        if(NOT EXISTS "${HOBBITPY_LLAMA_SRC}/CMakeLists.txt" OR NOT EXISTS "${HOBBITPY_LLAMA_SRC}/hobbitpy-patched.stamp")
            message(FATAL_ERROR "hobbitpy: HOBBITPY_LLAMA_SRC=${HOBBITPY_LLAMA_SRC} is not a llama.cpp tree "
                                "made by scripts/pack-device-check.sh (no hobbitpy-patched.stamp)")
        endif()
        file(READ "${HOBBITPY_LLAMA_SRC}/hobbitpy-patched.stamp" made)
        hobbitpy_llama_stamp(want)
        if(NOT made STREQUAL want)
            message(FATAL_ERROR "hobbitpy: ${HOBBITPY_LLAMA_SRC} was patched with another patch series than patches/")
        endif()
        set(${out_src_dir} "${HOBBITPY_LLAMA_SRC}" PARENT_SCOPE)
        return()
    endif()
    set(work "${CMAKE_BINARY_DIR}/_llama")
    set(src  "${work}/llama_cpp_python-0.3.36/vendor/llama.cpp")
    file(GLOB patches "${PROJECT_SOURCE_DIR}/patches/*.patch")
    list(SORT patches)

    # re-extract when the patch series changes, so a stale tree is never built
    hobbitpy_llama_stamp(stamp_content)
    set(stamp "${work}/patched.stamp")
    if(EXISTS "${stamp}")
        file(READ "${stamp}" old)
        if(old STREQUAL stamp_content AND EXISTS "${src}/CMakeLists.txt")
            set(${out_src_dir} "${src}" PARENT_SCOPE)
            return()
        endif()
    endif()

    if(DEFINED ENV{HOBBITPY_LLAMA_SDIST} AND NOT "$ENV{HOBBITPY_LLAMA_SDIST}" STREQUAL "")
        set(sdist "$ENV{HOBBITPY_LLAMA_SDIST}")
    else()
        set(sdist "${work}/llama_cpp_python-0.3.36.tar.gz")
        if(NOT EXISTS "${sdist}")
            message(STATUS "hobbitpy: downloading ${HOBBITPY_LLAMA_SDIST_URL}")
            file(DOWNLOAD "${HOBBITPY_LLAMA_SDIST_URL}" "${sdist}.part" STATUS st TLS_VERIFY ON)
            list(GET st 0 code)
            if(NOT code EQUAL 0)
                file(REMOVE "${sdist}.part")
                message(FATAL_ERROR "hobbitpy: could not download the llama.cpp source (${st}); "
                                    "set HOBBITPY_LLAMA_SDIST to a local llama_cpp_python-0.3.36.tar.gz")
            endif()
            file(RENAME "${sdist}.part" "${sdist}")
        endif()
    endif()
    file(SHA256 "${sdist}" got)
    if(NOT got STREQUAL HOBBITPY_LLAMA_SDIST_SHA256)
        message(FATAL_ERROR "hobbitpy: ${sdist} has sha256 ${got}, expected ${HOBBITPY_LLAMA_SDIST_SHA256}")
    endif()

    file(REMOVE_RECURSE "${work}/llama_cpp_python-0.3.36")
    file(ARCHIVE_EXTRACT INPUT "${sdist}" DESTINATION "${work}"
         PATTERNS "llama_cpp_python-0.3.36/vendor/llama.cpp/*")

    find_program(PATCH_EXE patch REQUIRED)
    foreach(p IN LISTS patches)
        execute_process(COMMAND "${PATCH_EXE}" -p1 --forward --batch --quiet -i "${p}"
                        WORKING_DIRECTORY "${src}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
        if(NOT rc EQUAL 0)
            message(FATAL_ERROR "hobbitpy: patch ${p} does not apply:\n${out}")
        endif()
    endforeach()
    file(WRITE "${stamp}" "${stamp_content}")
    file(WRITE "${src}/hobbitpy-patched.stamp" "${stamp_content}")
    set(${out_src_dir} "${src}" PARENT_SCOPE)
endfunction()

# the sdist's sha256 and each patch's, in order: what a patched tree was made from
function(hobbitpy_llama_stamp out)
    file(GLOB patches "${PROJECT_SOURCE_DIR}/patches/*.patch")
    list(SORT patches)
    set(content "${HOBBITPY_LLAMA_SDIST_SHA256}")
    foreach(p IN LISTS patches)
        file(SHA256 "${p}" h)
        string(APPEND content ";${h}")
    endforeach()
    set(${out} "${content}" PARENT_SCOPE)
endfunction()
