"""The one compiled part (metadata is in pyproject.toml).

``resilient._meshio`` moves the mesh's socket steps without the GIL
(resilient._native). It is optional: without a C compiler the install still
succeeds, and the same steps run in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "resilient._meshio",
            sources=["resilient/_meshio.c"],
            extra_compile_args=["-O3", "-Wall"],
            optional=True,
        )
    ]
)
