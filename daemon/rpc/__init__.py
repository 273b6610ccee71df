"""Generated from proto/ by proto/generate.sh. Do not edit."""
