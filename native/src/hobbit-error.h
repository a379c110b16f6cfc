// hobbit-error.h - the exception the runtime throws inside C++ and turns into a
// hobbit_status at the C boundary.
#pragma once

#include "hobbit.h"

#include <stdexcept>
#include <string>

struct hobbit_error : std::runtime_error {
    hobbit_status status;
    hobbit_error(hobbit_status status, const std::string & msg) : std::runtime_error(msg), status(status) {}
};
