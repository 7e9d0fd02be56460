"""Build shim: cffi's API-mode modules can only be declared through setup() (cffi_modules).

Every ``native/build_*.py`` defines an ``ffibuilder`` that compiles one extension module.
"""

import glob

from setuptools import setup

setup(cffi_modules=[f"{path}:ffibuilder" for path in sorted(glob.glob("native/build_*.py"))])
