/* it_outputs.c - integration tests (see itest.h). */
#include <criterion/criterion.h>

#include "itest.h"
#include "proc.h"
