#!/usr/bin/env python3
"""Write a C file defining NAME (const char *) and NAME_len as the bytes of FILE: the live page is compiled into psd."""
import sys

src, out, name = sys.argv[1:4]
data = open(src, "rb").read()
with open(out, "w") as f:
    f.write("/* generated from %s by server/www/embed.py: do not edit */\n#include <stddef.h>\n" % src.split("/")[-1])
    f.write("static const unsigned char bytes[] = {\n")
    for i in range(0, len(data), 20):
        f.write("    " + ", ".join(str(b) for b in data[i:i + 20]) + ",\n")
    f.write("    0};\nconst char *const %s = (const char *)bytes;\nconst size_t %s_len = %d;\n" % (name, name, len(data)))
