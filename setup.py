"""The one compiled part (metadata is in pyproject.toml).

``resilient.links._stepio`` moves the mesh's socket steps without the GIL
(resilient.links.native_steps). It is optional: without a C compiler the install still
succeeds, and the same steps run in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "resilient.links._stepio",
            sources=["resilient/links/_stepio.c"],
            extra_compile_args=["-O3", "-Wall"],
            optional=True,
        )
    ]
)
