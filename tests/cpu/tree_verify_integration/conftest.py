# SPDX-License-Identifier: Apache-2.0
# _setup.py is imported by plain name: pytest puts this folder on the import path for its
# conftest and test modules.
