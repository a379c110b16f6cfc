// hobbit-params.h - what a hobbit_params may hold: the defaults, the range of each numeric
// field, and the check of a whole struct. The one place these are written: the C API serves
// them (hobbit_default_params, hobbit_param_ranges), hobbitpy's OffloadConfig reads both, and
// hobbit_request_offload and the runtime refuse what params_problem names.
#pragma once

#include "hobbit.h"

#include <string>

// what is wrong with params, or "" (nothing is read past the first problem)
std::string params_problem(const hobbit_params & params);
