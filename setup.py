"""The compiled index core (index/_kvcore.c), built with the machine's C compiler at install time;
everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "index._kvcore",
            sources=["index/_kvcore.c"],
            depends=["index/_kvingest.h", "index/_kvrecv.h"],
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-fno-strict-aliasing",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
            ],
        )
    ]
)
