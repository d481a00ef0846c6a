#!/bin/bash
# Oracle for hello-file.
set -euo pipefail
echo 'Hello, world!' > hello.txt
