# SPDX-License-Identifier: Apache-2.0
# The helpers in this folder (_interp.py) are imported by plain name: pytest puts this folder
# on the import path for its conftest and test modules.
