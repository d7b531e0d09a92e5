/* weights_cmp A B: exit 0 when two weights files hold the same model (the
 * run id aside: ps_weights_same, the tests' comparison), 1 with the first
 * difference when not, 2 when one cannot be read. For bench/same_weights.sh. */
#include <stdio.h>

#include "ps_weights.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: weights_cmp A.bin B.bin\n");
        return 2;
    }
    char why[1024];
    int same = ps_weights_same(argv[1], argv[2], why, sizeof why);
    if (same == 1) {
        printf("same: %s %s\n", argv[1], argv[2]);
        return 0;
    }
    fprintf(stderr, "weights_cmp: %s\n", why);
    return same == 0 ? 1 : 2;
}
