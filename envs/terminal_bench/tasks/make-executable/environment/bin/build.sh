#!/bin/bash
set -e
echo "built from $(basename "$PWD")" > build.log
