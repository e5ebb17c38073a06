"""pip install --no-build-isolation ./python

Builds shardopt._C with CMake from the repository this directory belongs to
(the client library and the module only; no server, tests or CUDA), and
installs it with the pure-Python modules. Needs only Debian 12's packages
(scripts/install-deps.sh) and no network.
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                               "-DSHARDOPT_BUILD_TESTS=OFF", "-DSHARDOPT_BUILD_BENCH=OFF", "-DSHARDOPT_CUDA=OFF",
                               f"-DSHARDOPT_PYTHON={sys.executable}"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build, "--target", "shardopt_py", "-j", jobs])
        (built,) = glob.glob(os.path.join(build, "python", "shardopt", "_C.*so"))
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built, target)


setup(ext_modules=[Extension("shardopt._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
