"""Checks the fragment layouts of flash_step_kv8 (attention.cu, fp8-cache decode) on the host.

Models mma.sync m16n8k16 as the PTX ISA lays out its fragments, builds the A/B fragments the way
flash_step_kv8 does (the permuted d order of Q K^T, the byte-permuted V pairs, the kv8_col output
columns incl. the D % 32 = 16 tail) and compares S = Q K^T and O = P V with numpy; also checks that
the K and V shared-memory loads are free of bank conflicts with the Kv8Row::RS row stride.
Run: python3 crates/tm-kernels/host_emu/attn_kv8_layout.py (needs numpy; prints "ok D" per head size).
"""
import numpy as np
rng=np.random.default_rng(1)
def mma(afr,bfr):
    # afr[lane][r][j], bfr[lane][r][j] -> c[lane][e]
    A=np.zeros((16,16)); B=np.zeros((16,8))
    for lane in range(32):
        gid,tig=lane>>2,lane&3
        for r in range(4):
            for j in range(2):
                A[gid+8*(r&1), 2*tig+j+8*(r>>1)]=afr[lane][r][j]
        for r in range(2):
            for j in range(2):
                B[2*tig+j+8*r, gid]=bfr[lane][r][j]
    C=A@B
    return [[C[(lane>>2)+8*(e>>1), 2*(lane&3)+(e&1)] for e in range(4)] for lane in range(32)]
def run(D):
    Q=rng.standard_normal((16,D)); K=rng.standard_normal((16,D)); V=rng.standard_normal((16,D))
    # S = Q K^T
    s=[[[0.0]*4 for _ in range(2)] for _ in range(32)]
    for ks in range(D//16):
        afr=[]; 
        for lane in range(32):
            gid,tig=lane>>2,lane&3
            q0=Q[gid, ks*16+4*tig: ks*16+4*tig+4]; q1=Q[gid+8, ks*16+4*tig: ks*16+4*tig+4]
            # uint2 q0: x = elems 0,1 ; y = elems 2,3 ; a = {q0.x, q1.x, q0.y, q1.y}
            afr.append([[q0[0],q0[1]],[q1[0],q1[1]],[q0[2],q0[3]],[q1[2],q1[3]]])
        for nt in range(2):
            bfr=[]
            for lane in range(32):
                gid,tig=lane>>2,lane&3
                k=K[nt*8+gid, ks*16+4*tig: ks*16+4*tig+4]  # bytes 0..3
                bfr.append([[k[0],k[1]],[k[2],k[3]]])
            c=mma(afr,bfr)
            for lane in range(32):
                for e in range(4): s[lane][nt][e]+=c[lane][e]
    S=np.zeros((16,16))
    for lane in range(32):
        gid,tig=lane>>2,lane&3
        for nt in range(2):
            for e in range(4):
                S[gid+8*(e>>1), nt*8+2*tig+(e&1)]=s[lane][nt][e]
    assert np.allclose(S, Q@K.T), "S"
    P=rng.standard_normal((16,16))
    # P in s layout
    for lane in range(32):
        gid,tig=lane>>2,lane&3
        for nt in range(2):
            for e in range(4): s[lane][nt][e]=P[gid+8*(e>>1), nt*8+2*tig+(e&1)]
    afr=[[[s[l][0][0],s[l][0][1]],[s[l][0][2],s[l][0][3]],[s[l][1][0],s[l][1][1]],[s[l][1][2],s[l][1][3]]] for l in range(32)]
    o=[[[0.0]*4 for _ in range(D//8)] for _ in range(32)]
    def byteperm(x,y,sel):
        bytes8=list(x)+list(y)
        return [bytes8[sel&15], bytes8[(sel>>4)&15]]
    for g in range(D//32):
        bfrs=[[None]*32 for _ in range(4)]
        for lane in range(32):
            gid,tig=lane>>2,lane&3
            off=g*32+4*gid
            rows=[2*tig,2*tig+1,2*tig+8,2*tig+9]
            x=[V[r,off:off+4] for r in rows]
            for i in range(4):
                sel=i|((4+i)<<4)
                bfrs[i][lane]=[byteperm(x[0],x[1],sel),byteperm(x[2],x[3],sel)]
        for i in range(4):
            c=mma(afr,bfrs[i])
            for lane in range(32):
                for e in range(4): o[lane][4*g+i][e]+=c[lane][e]
    if D%32:
        g=D//32
        bfrs=[[None]*32 for _ in range(2)]
        for lane in range(32):
            gid,tig=lane>>2,lane&3
            off=g*32+2*gid
            rows=[2*tig,2*tig+1,2*tig+8,2*tig+9]
            x=[list(V[r,off:off+2])+[0,0] for r in rows]
            for i in range(2):
                sel=i|((4+i)<<4)
                bfrs[i][lane]=[byteperm(x[0],x[1],sel),byteperm(x[2],x[3],sel)]
        for i in range(2):
            c=mma(afr,bfrs[i])
            for lane in range(32):
                for e in range(4): o[lane][4*g+i][e]+=c[lane][e]
    def col(nt,c):
        g,i=nt>>2,nt&3
        return g*32+4*c+i if g < D//32 else g*32+2*c+i
    O=np.full((16,D),np.nan)
    for lane in range(32):
        gid,tig=lane>>2,lane&3
        for nt in range(D//8):
            O[gid, col(nt,2*tig)]=o[lane][nt][0]; O[gid, col(nt,2*tig+1)]=o[lane][nt][1]
            O[gid+8, col(nt,2*tig)]=o[lane][nt][2]; O[gid+8, col(nt,2*tig+1)]=o[lane][nt][3]
    assert np.allclose(O, P@V), f"O {D}"
    print("ok",D)
for D in [32,64,80,96,112,128,160,192,256]: run(D)
# bank conflicts: K loads and V loads
def rs(D): return D+16 if (D//16)%2==0 else D
for D in [32,64,80,96,112,128,160,192,256]:
    R=rs(D); worst=0
    for ks in range(D//16):
        for nt in range(2):
            banks=[(((nt*8+(l>>2))*R + ks*16+4*(l&3))//4)%32 for l in range(32)]
            worst=max(worst, max(banks.count(b) for b in set(banks)))
    for g in range(D//32):
        for r0 in [0,1,8,9]:
            banks=[(((2*(l&3)+r0)*R + g*32+4*(l>>2))//4)%32 for l in range(32)]
            worst=max(worst, max(banks.count(b) for b in set(banks)))
    print(D, R, "worst bank multiplicity", worst)
    assert worst == 1, f"bank conflicts at D = {D}"
