"""The compiled index core (index/_kvcore.c) and the decision's scoring kernel
(router/decision/_kernel.c), built with the machine's C compiler at install time;
everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "index._kvcore",
            sources=["index/_kvcore.c"],
            depends=["index/_kvingest.h", "index/_kvrecv.h", "index/_kvzmq.h"],
            libraries=["dl"],  # dlopen/dlsym (index/_kvrecv.h): in libc from glibc 2.34, libdl before
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-fno-strict-aliasing",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
            ],
        ),
        Extension(
            "router.decision._kernel",
            sources=["router/decision/_kernel.c"],
            # no fused multiply-add: the scores round exactly as Python's arithmetic does
            extra_compile_args=["-O2", "-std=gnu11", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ]
)
