"""triton_lib"""
