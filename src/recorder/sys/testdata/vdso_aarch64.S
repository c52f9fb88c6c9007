// An aarch64 vDSO's shape for sys/vdso.rs's tests: the kernel's signal return
// trampoline (arch/arm64/kernel/vdso/sigreturn.S: a nop before it, no size)
// and a function with a size.
	.text
	.globl __kernel_clock_gettime
	.type __kernel_clock_gettime, %function
__kernel_clock_gettime:
	mov	x0, #0
	ret
	.size __kernel_clock_gettime, . - __kernel_clock_gettime
	nop
	.globl __kernel_rt_sigreturn
__kernel_rt_sigreturn:
	mov	x8, #139	// __NR_rt_sigreturn
	svc	#0
