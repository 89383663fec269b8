"""Build script; the configuration lives in setup.cfg."""

import setuptools

setuptools.setup()
