"""pip install . -- builds the extension flatep._C through the project's CMake (the same targets as a CMake build)
and installs it with the pure-Python package python/flatep.

Environment: FLATEP_CMAKE_ARGS (extra CMake arguments, e.g. "-DFLATEP_CUDA=OFF"), FLATEP_BUILD_JOBS (parallel jobs;
default: all cores). Needs CMake >= 3.25, a C++20 compiler and pybind11 (the Python package or pybind11-dev).
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        args = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DFLATEP_BUILD_PYTHON=ON",
            "-DFLATEP_BUILD_TESTS=OFF",
            "-DFLATEP_BUILD_TOOLS=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        try:
            import pybind11

            args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass  # CMake finds a system pybind11 (pybind11-dev) itself
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            args += ["-G", "Ninja"]
        args += shlex.split(os.environ.get("FLATEP_CMAKE_ARGS", ""))
        jobs = os.environ.get("FLATEP_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir] + args)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "flatep_python", "-j", jobs])
        built = glob.glob(os.path.join(build_dir, "python", "flatep", "_C*"))
        if len(built) != 1:
            raise RuntimeError(f"flatep: expected one built extension in {build_dir}/python/flatep, found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)


setup(
    license="MIT",  # as pyproject.toml: LICENSE, copyright the FlatEP authors
    license_files=["LICENSE"],
    package_dir={"": "python"},
    packages=["flatep", "flatep.integrations"],
    ext_modules=[CMakeExtension("flatep._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    options={"build": {"build_base": "build-pip"}, "egg_info": {"egg_base": "build-pip"}},
)
