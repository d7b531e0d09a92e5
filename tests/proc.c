typedef int proc_placeholder_t;
