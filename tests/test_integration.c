#include <criterion/criterion.h>
Test(short, placeholder) { cr_assert(1); }
